# >>> ch20 file: the tensor-parallel MTP layer
"""The MTP drafter of chapter 09 cut across the ranks, as the target is: every rank holds a shard of the
MTP layer and all of them draft the same tokens.

The layer is model/mtp.py's MTPLayer, whose forward is inherited unchanged. Its halves are built as the
target's layers are:

    self_attn     TPAttention: q, k, v by heads, o_proj row-parallel (one all-reduce); its K and V, this
                  rank's KV heads, go to the drafter's KV pool, which SpecRunner sizes from the target's
                  (already the rank's heads)
    mlp           TPMLP: gate, up by columns, down_proj row-parallel (one all-reduce)
    eh_proj       replicated: its input, cat(enorm(embedding), hnorm(hidden)), is whole on every rank (the
                  embedding and the target's hidden state both come out of an all-reduce), and the layer
                  is small ([hidden, 2*hidden]), so every rank computes the whole mix, with no collective
    norms         replicated (enorm, hnorm, the layer's two, shared_head.norm)
    embedding,    the target's VocabParallelEmbedding and ParallelLMHead, shared: the draft logits come
    head          back whole on every rank, so every rank's argmax picks the same draft

So a drafter pass costs what one target layer costs, plus the head's all-gather. `load_tp_mtp` reads the
checkpoint's `model.layers.{num_hidden_layers}.*` as the target's loader reads its layers: only this
rank's slice of each tensor.

References: SGLang's deepseek_nextn.py, whose draft layer is built from the target's parallel layers
(a ReplicatedLinear eh_proj, the shared VocabParallelEmbedding and ParallelLMHead).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minioverlap.model.mtp import MTPLayer, mtp_tensors
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.loader import read_shards
from minioverlap.parallel.model import TPMLP, TPAttention, TPQwen3ForCausalLM


class TPMTPLayer(MTPLayer):
    """MTPLayer holding one rank's shard: attention and MLP sharded as the target's layers are, eh_proj
    and the norms whole, the target's parallel embedding and head shared. The same forward(input_ids,
    hidden, positions, ctx) -> [T, hidden] and compute_logits -> fp32 logits [N, vocab], whole on every rank."""

    def __init__(self, target: TPQwen3ForCausalLM, group: TPGroup) -> None:
        super().__init__(target)                   # the rank's view of the config: its heads, its MLP width
        self.self_attn = TPAttention(target.full_config, 0, group)      # layer 0 of the drafter's KV pool
        self.mlp = TPMLP(target.full_config, group)


def load_tp_mtp(model_dir: Path, target: TPQwen3ForCausalLM, group: TPGroup) -> TPMTPLayer:
    """This rank's TPMTPLayer, each parameter filled with its shard, on the target's device and in its
    dtype. As load_mtp: a checkpoint without an MTP layer is a ValueError, a missing tensor a CheckpointError,
    and each tensor's full shape is checked (from the file's header) before its slice is read."""
    with torch.device("meta"):
        mtp = TPMTPLayer(target, group)
        full = MTPLayer(Qwen3ForCausalLM(target.full_config))       # the checkpoint's shapes, on no memory
    prefix, files, expected = mtp_tensors(model_dir, target.full_config, full)
    weight = target.model.embed_tokens.weight
    shards = read_shards(files, expected, mtp, prefix)
    mtp.load_state_dict({name.removeprefix(prefix): t.to(device=weight.device, dtype=weight.dtype)
                         for name, t in shards.items()}, assign=True)
    return mtp.eval()
