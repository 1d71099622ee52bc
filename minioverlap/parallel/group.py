# >>> ch20 file: the tensor-parallel group and its collectives
"""The tensor-parallel group: which rank this process is, how many there are, and the three collectives
the engine needs.

Every rank runs the same program on its own shard of the weights. The ranks meet in three ways:

    all_reduce(t)         sum each rank's partial result (after o_proj, down_proj, the embedding)
    all_gather(t, dim)    put the ranks' pieces side by side (the LM head's slices of the vocabulary)
    broadcast_object(x)   rank 0's Python object on every rank (what the scheduler received this step)

On a GPU the collectives go over NCCL; on a CPU over gloo. With one rank, `TPGroup.single()`, each of
them is the identity and torch.distributed is never touched, so a single-device engine pays nothing.

References: Megatron-LM (Shoeybi et al., 2019) for the split; SGLang's parallel_state.py and vLLM's
distributed/communication_op.py, whose names (tp_rank, tp_size) this file keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0      # a collective that waits this long for a dead peer raises instead of hanging


@dataclass
class TPGroup:
    """One process's place in the tensor-parallel group."""

    tp_rank: int = 0
    tp_size: int = 1
    process_group: dist.ProcessGroup | None = None     # None: one rank, no torch.distributed

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one: every collective returns its input."""
        return cls()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place; returns t."""
        if self.tp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t (all of one shape), concatenated along dim in rank order."""
        if self.tp_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank src's obj (any picklable object) on every rank; the other ranks' obj is ignored."""
        if self.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    def destroy(self) -> None:
        """Leave the group (the last collective must be done on every rank)."""
        if self.process_group is not None:
            dist.destroy_process_group()
            self.process_group = None


def init_group(rank: int, world_size: int, init_method: str, device: str | torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group of world_size processes that meet at init_method ("file:///tmp/x" or
    "tcp://127.0.0.1:29500"): NCCL for a CUDA device, gloo otherwise. Every rank must call it."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TPGroup(tp_rank=rank, tp_size=world_size, process_group=dist.group.WORLD)
