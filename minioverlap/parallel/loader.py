# >>> ch20 file: loading a checkpoint as one rank's shards
"""Loading a Qwen3 checkpoint as one tensor-parallel rank's shards.

Each rank reads from the safetensors files only its own slice of each tensor: safetensors' `get_slice`
reads the bytes of the rows (or columns) asked for, never the whole tensor, so a rank of an 8-way group
reads about an eighth of the model (plus the replicated norms). Which slice is the layer's business: a
parallel layer's `weight_slice` (layers.py) indexes its shard in the full tensor.

The checks are model/loader.py's: every tensor the config implies is present, none is unexpected, and
each has the full shape the config implies, checked from the file's header before any slice is read.

One loader serves both ways of cutting the model: `load_tp_model` fills TPQwen3ForCausalLM (model.py),
every layer sharded; `load_dp_model` fills DPAttentionQwen3ForCausalLM (dp_attention.py), whose MLP
projections alone have a weight_slice, so that a rank reads its MLP shards and everything else whole.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from minioverlap.model.loader import CheckpointError, check_shapes, checkpoint_tensors, load_config, read_tensors
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.parallel.dp_attention import DPAttentionQwen3ForCausalLM
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.model import TPQwen3ForCausalLM

ALL = (slice(None),)


def shard_index(model: nn.Module, name: str) -> tuple[slice, ...]:
    """The index of parameter `name`'s shard in the full checkpoint tensor: its layer's weight_slice, or
    the whole tensor for a replicated one (the norms, the MTP layer's eh_proj)."""
    module = model.get_submodule(name.rpartition(".")[0])
    return getattr(module, "weight_slice", ALL)


def read_shards(files: dict[str, Path], expected: dict[str, tuple[int, ...]], model: nn.Module,
                prefix: str = "") -> dict[str, torch.Tensor]:
    """Each expected tensor's shard, read from its file without the rest of the tensor. A tensor's name is
    `prefix` and the model's parameter name (the MTP layer's tensors: model.layers.{L}.*)."""

    def read_shard(f, name: str) -> torch.Tensor:
        part = f.get_slice(name)
        full = torch.empty(part.get_shape(), device="meta")         # the full shape, from the file's header
        check_shapes(files, {name: expected[name]}, {name: full})
        return part[shard_index(model, name.removeprefix(prefix))]

    return read_tensors(files, list(expected), read=read_shard)


def load_tp_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device, group: TPGroup) -> TPQwen3ForCausalLM:
    """This rank's TPQwen3ForCausalLM from config.json, each parameter filled with its shard."""
    return load_rank_model(TPQwen3ForCausalLM, model_dir, dtype, device, group)


def load_dp_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device,
                  group: TPGroup) -> DPAttentionQwen3ForCausalLM:
    """This rank's DPAttentionQwen3ForCausalLM from config.json: its shard of each MLP, the rest whole."""
    return load_rank_model(DPAttentionQwen3ForCausalLM, model_dir, dtype, device, group)


def load_rank_model(model_class: type[TPQwen3ForCausalLM] | type[DPAttentionQwen3ForCausalLM], model_dir: Path,
                    dtype: torch.dtype, device: str | torch.device, group: TPGroup) -> Qwen3ForCausalLM:
    """model_class(config, group) built from config.json on no memory, each parameter filled with this
    rank's shard of its tensor (the whole tensor for a parameter whose module has no weight_slice)."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = model_class(config, group)
        full = Qwen3ForCausalLM(config)                          # the checkpoint's shapes, on no memory
    files, expected = checkpoint_tensors(model_dir, config, full)
    shards = read_shards(files, expected, model)
    head = shards.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    if head is not None and not torch.equal(head, shards["model.embed_tokens.weight"]):
        raise CheckpointError(f"{files['lm_head.weight']}: config.json ties the head to the embedding, "
                              "but tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'")
    state = {name: t.to(device=device, dtype=dtype) for name, t in shards.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
