# >>> ch20 file: the tensor-parallel group and its collectives
"""The tensor-parallel group: which rank this process is, how many there are, and the collectives the
engine needs.

Every rank runs the same program on its own shard of the weights. The ranks meet in two groups. The
device group carries the model's collectives:

    all_reduce(t)         sum each rank's partial result (after o_proj, down_proj, the embedding)
    all_gather(t, dim)    put the ranks' pieces side by side (the LM head's slices of the vocabulary)

and the CPU group the schedulers' exchanges, of host values:

    broadcast_object(x)   rank 0's Python object on every rank (what the scheduler received this step)
    all_gather_ints(v)    every rank's few integers (fingerprints, loads, a step's token counts)
    all_gather_object(x)  every rank's Python object (DP attention: each rank's replies, for rank 0)

On a GPU the device group is NCCL, on a CPU gloo; the CPU group is gloo on both, as SGLang's schedulers
exchange Python objects over a gloo "cpu_group" beside NCCL. Two groups also keep the two kinds of
traffic apart: a rank that skipped a step waits in the CPU group while the others wait in the device
group, and each side's collective times out, rather than pairing with a collective of another size
(which gloo answers by aborting the process). With one rank, `TPGroup.single()`, each collective is the
identity and torch.distributed is never touched, so a single-device engine pays nothing.

References: Megatron-LM (Shoeybi et al., 2019) for the split; SGLang's parallel_state.py and vLLM's
distributed/communication_op.py, whose names (tp_rank, tp_size) this file keeps.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

DEFAULT_TIMEOUT_S = 60.0      # a collective that waits this long for a stuck peer raises instead of hanging
JOIN_TIMEOUT_S = 300.0        # joining waits this long for the slowest rank's process to start
IDLE_TIMEOUT = timedelta(days=365)   # no deadline: a follower waits this long for rank 0's next inbox


@dataclass
class TPGroup:
    """One process's place in the tensor-parallel group. The group is a process group of its own, made
    from a store (not torch.distributed's default group), so that a process may hold several engines, one
    after the other or side by side, each with its own ranks."""

    tp_rank: int = 0
    tp_size: int = 1
    process_group: dist.ProcessGroup | None = None     # the device group; None: one rank, no torch.distributed
    cpu_group: dist.ProcessGroup | None = None         # the CPU group (gloo), for the schedulers' exchanges
    timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)   # each collective's deadline

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one: every collective returns its input."""
        return cls()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place; returns t."""
        if self.tp_size > 1:
            self.process_group.allreduce([t], self.options(AllreduceOptions())).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t (all of one shape), concatenated along dim in rank order."""
        if self.tp_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        self.process_group.allgather([parts], [t], self.options(AllgatherOptions())).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: object, src: int = 0, idle: bool = False) -> object:
        """Rank src's obj (any picklable object) on every rank; the other ranks' obj is ignored. As
        torch.distributed's broadcast_object_list does it: the pickle's length, then its bytes, each a
        broadcast of a host tensor over the CPU group. idle: the other ranks wait for the length without
        a deadline (an engine with nothing to do sends nothing; a server is idle most of its life)."""
        if self.tp_size == 1:
            return obj
        data = pickle.dumps(obj) if self.tp_rank == src else b""
        size = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), src, IDLE_TIMEOUT if idle else None)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
        return pickle.loads(self.broadcast(buffer, src).numpy().tobytes())

    def broadcast(self, t: torch.Tensor, src: int = 0, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank src's host tensor t on every rank, in place, over the CPU group; returns t. timeout: this
        wait's own deadline (None: the group's)."""
        opts = self.options(BroadcastOptions(), timeout)
        opts.rootRank = src
        self.cpu_group.broadcast([t], opts).wait()
        return t

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of integers (each rank gives as many), in rank order, over the CPU group."""
        if self.tp_size == 1:
            return [list(values)]
        t = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        self.cpu_group.allgather([parts], [t], self.options(AllgatherOptions())).wait()
        return [p.tolist() for p in parts]

    def all_gather_object(self, obj: object) -> list:
        """Every rank's obj (any picklable object), in rank order, over the CPU group: the pickles' lengths,
        then the pickles, each padded to the longest."""
        if self.tp_size == 1:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [n for [n] in self.all_gather_ints([len(data)])]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.tp_size)]
        self.cpu_group.allgather([parts], [mine], self.options(AllgatherOptions())).wait()
        return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(parts, sizes)]

    def options(self, opts, timeout: timedelta | None = None):
        """A collective's options with its deadline: timeout, or the group's."""
        opts.timeout = timeout or self.timeout
        return opts

    def destroy(self) -> None:
        """Leave the groups."""
        self.process_group = self.cpu_group = None


def init_group(rank: int, world_size: int, init_method: str, device: str | torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group of world_size processes that meet at init_method ("file:///tmp/x" or
    "tcp://127.0.0.1:29500"): NCCL for a CUDA device, gloo otherwise. Every rank must call it. The
    broadcasts of the scheduler's inbox go over gloo on a CPU, as SGLang's CPU group carries them.
    Joining waits up to JOIN_TIMEOUT_S for the other ranks (a process that imports torch and loads a shard
    may take a while to start); each collective after it, timeout_s."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    device = torch.device(device)
    join, timeout = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)), timedelta(seconds=timeout_s)
    store = make_store(init_method, rank, world_size, join)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, world_size, gloo_options(join))
    device_store = dist.PrefixStore("device", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return TPGroup(rank, world_size, dist.ProcessGroupNCCL(device_store, rank, world_size), cpu_group, timeout)
    return TPGroup(rank, world_size, dist.ProcessGroupGloo(device_store, rank, world_size, gloo_options(join)),
                   cpu_group, timeout)


def gloo_options(timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """Gloo over the loopback interface: the ranks are processes of one host (minioverlap/ranks.py
    starts them), so they need no network, nor a host name that resolves to one."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return opts


def make_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """Where the ranks find each other: a file they share, or rank 0's TCP port."""
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, world_size)
    if url.scheme == "tcp":
        return dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout)
    raise ValueError(f"init_method must be file:///path or tcp://host:port, got {init_method!r}")
