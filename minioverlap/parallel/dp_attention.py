# >>> ch20 file: DP attention: attention on each rank's own tokens, the MLP tensor-parallel over all of them
"""DP attention: every rank serves its own requests and runs attention alone over their tokens, with the
whole attention weights; each layer's MLP runs tensor-parallel over the tokens of every rank.

Tensor parallelism (model.py) splits attention by heads, and every rank caches every request's K and V
for its heads. With few KV heads that stops paying: at tp 4 with 2 KV heads, each KV head is copied onto
two ranks. DP attention splits the requests instead. Rank r has its own batch and its own KV pool, which
holds all the KV heads of its requests only, so the ranks together hold tp_size times as many requests'
K and V, no head copied. The MLP, the larger part of each layer's weights, stays split as in TP.

What each rank holds:

    replicated  the embedding, q/k/v/o_proj, the QK-norms and layer norms, the final norm, the LM head
    split       gate_proj, up_proj by columns and down_proj by its input features: TPMLP's shards

Per layer, on rank r with n_r tokens of its own, and max_tokens the largest n over the ranks:

    attention   qwen3's own, on this rank's n_r tokens and its own KV pool: no communication
    gather      pad x [n_r, hidden] with zero rows to [max_tokens, hidden]; all_gather along dim 0
                -> [tp_size * max_tokens, hidden], rank s's tokens from row s * max_tokens
    MLP         gate and up on this rank's columns of all those rows, silu(gate) * up, down_proj
                -> a partial output of every row; all_reduce sums the ranks' parts
    scatter     keep rows [r * max_tokens, r * max_tokens + n_r): this rank's own tokens

So a layer costs an all-gather and an all-reduce of tp_size * max_tokens rows. An all-reduce followed by
a slice delivers every rank's rows to every rank and drops all but its own; a reduce-scatter would send
each rank only its own rows (SGLang uses one in its max_len mode). Here the all-reduce is the one the row-
parallel down_proj already does, so the MLP is TPMLP's, unchanged.

max_tokens. An all-gather takes one shape from every rank, and the ranks' token counts differ, so each
pads to the largest. The ranks' schedulers agree on it before the step, over the CPU group; the runner
hands it to the model with `set_max_tokens`, which writes it into the one `DPTokens` every DPMLP reads.
The padding rows are zeros: their MLP output is zero, and it is dropped with the other ranks' rows.

The empty batch. A rank with no tokens this step must still join every layer's all-gather and all-reduce,
or the other ranks wait for it until the collective times out. It calls forward with no tokens
(input_ids [0], ctx None), which runs `idle_forward`: each layer's MLP on zero rows of its own, padded to
max_tokens. Nothing else in a layer is collective (attention, the norms, the embedding and the head are
whole on every rank), so the idle rank makes the same collectives, in the same order, as the others.

The config. Attention is whole, so `config` is the checkpoint's (`full_config` too): the KV pool is
sized for all num_key_value_heads, and only intermediate_size must divide by tp_size (check_dp_size);
the query heads, KV heads and vocabulary need not.

References: SGLang's layers/dp_attention.py (dp_gather, now dp_gather_partial and dp_gather_replicate, and
dp_scatter; DpPaddingMode.MAX_LEN, its "max_len" mode: each rank padded to the largest count and gathered
with an all-gather, beside SUM_LEN's all-reduce into a buffer of the sum) and layers/communicator.py
(LayerCommunicator: where a layer gathers its tokens before the MLP and scatters them after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minioverlap.model.qwen3 import AttentionContext, Qwen3Config, Qwen3ForCausalLM
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.model import TPMLP


def check_dp_size(config: Qwen3Config, tp_size: int) -> None:
    """tp_size must divide the MLP width, the one thing DP attention splits; otherwise a ValueError naming
    tp_size and intermediate_size. The heads and the vocabulary are whole on every rank."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if config.intermediate_size % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide intermediate_size ({config.intermediate_size}): "
                         "DP attention splits the MLP's columns over the ranks (attention is not split)")


@dataclass
class DPTokens:
    """The step's max_tokens: the most tokens any rank runs in this step, agreed before it. One object,
    owned by the model and read by every layer's DPMLP; 0 until the first set_max_tokens."""

    max_tokens: int = 0


def dp_gather(x: torch.Tensor, max_tokens: int, group: TPGroup) -> torch.Tensor:
    """This rank's rows x [n, hidden] -> every rank's [tp_size * max_tokens, hidden]: x padded with zero
    rows to max_tokens, the ranks' padded blocks stacked in rank order."""
    if x.shape[0] > max_tokens:
        raise ValueError(f"rank {group.tp_rank} has {x.shape[0]} tokens, more than max_tokens ({max_tokens}): "
                         "set_max_tokens must be given the largest count over the ranks before each step")
    padded = F.pad(x, (0, 0, 0, max_tokens - x.shape[0]))
    return group.all_gather(padded, dim=0)


def dp_scatter(out: torch.Tensor, num_tokens: int, max_tokens: int, group: TPGroup) -> torch.Tensor:
    """Every rank's rows [tp_size * max_tokens, hidden] -> this rank's own num_tokens rows."""
    start = group.tp_rank * max_tokens
    return out[start:start + num_tokens]


class DPMLP(TPMLP):
    """TPMLP over every rank's tokens: x [n, hidden], this rank's own -> the MLP's output [n, hidden].
    Gather the ranks' rows (padded to max_tokens), run this rank's columns of gate/up/down on all of them
    (down_proj's all-reduce sums the ranks' parts), keep this rank's rows."""

    def __init__(self, config: Qwen3Config, group: TPGroup, tokens: DPTokens) -> None:
        super().__init__(config, group)
        self.group, self.tokens = group, tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        max_tokens = self.tokens.max_tokens
        everyone = dp_gather(x, max_tokens, self.group)
        return dp_scatter(super().forward(everyone), x.shape[0], max_tokens, self.group)


class DPAttentionQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM for DP attention: qwen3's own modules, whole, except each layer's MLP, a DPMLP
    holding this rank's shard. The same forward(input_ids, positions, ctx) -> hidden [T, hidden] over
    this rank's own tokens, and compute_logits(hidden) -> fp32 logits [N, vocab] from the whole head, with
    no communication. Call set_max_tokens before each forward. Build it on the meta device and fill it
    with load_dp_model (parallel/loader.py)."""

    def __init__(self, config: Qwen3Config, group: TPGroup) -> None:
        check_dp_size(config, group.tp_size)
        super().__init__(config)
        self.full_config, self.group, self.tokens = config, group, DPTokens()
        for layer in self.model.layers:                     # qwen3's DecoderLayer, only its MLP split
            layer.mlp = DPMLP(config, group, self.tokens)

    def set_max_tokens(self, max_tokens: int) -> None:
        """The step's max_tokens: the largest token count over the ranks, this rank's included."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.tokens.max_tokens = max_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        """input_ids and positions [T] -> final hidden states [T, hidden]. With no tokens (T = 0, ctx None:
        the empty batch of an idle rank) there is nothing to attend to, and only the MLPs' collectives run."""
        if input_ids.shape[0] == 0:
            return self.idle_forward()
        return super().forward(input_ids, positions, ctx)

    def idle_forward(self) -> torch.Tensor:
        """The empty batch: every layer's MLP on zero rows of this rank's own, so that this rank joins each
        layer's all-gather and all-reduce as the ranks with tokens do. Attention, the norms and the
        embedding have no collective and no rows to work on, and are skipped. Returns [0, hidden]."""
        weight = self.model.embed_tokens.weight
        x = weight.new_empty(0, self.config.hidden_size)
        for layer in self.model.layers:
            x = layer.mlp(x)
        return x
