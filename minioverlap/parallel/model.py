# >>> ch20 file: the tensor-parallel Qwen3
"""Qwen3 cut across tp_size devices: every rank holds a slice of every layer, and all of them run the
same batch.

The arithmetic is qwen3.py's own. `TPAttention` and `TPMLP` are qwen3's Attention and MLP, built for
this rank's share of the heads and of the MLP width, whose projections are then swapped for the
parallel layers of layers.py; their forward is inherited unchanged. Per layer:

    attention   q, k, v column-parallel by heads -> QK-norm, RoPE, attention on this rank's heads
                -> o_proj row-parallel: one all-reduce
    MLP         gate, up column-parallel -> silu(gate) * up on this rank's columns
                -> down_proj row-parallel: one all-reduce

The norms and RoPE are replicated (each rank holds all of them; they are tiny). The embedding and LM
head split the vocabulary; compute_logits returns the full [N, vocab] scores on every rank, so that
every rank samples the same tokens and its scheduler stays in step with the others.

The rank's view of the config. `model.config` is not the checkpoint's: it is `rank_config`, the same
Qwen3Config with num_attention_heads, num_key_value_heads and intermediate_size as this rank holds
them. Everything that sizes memory or reads heads from the config (the KV pool: num_key_value_heads
heads of head_dim per slot; the contiguous cache of chapter 01) then sizes it for this rank's heads,
and the attention backends, which read head counts from q, k and v's shapes, need no change. The vocab
stays whole in the view: the logits are. `model.full_config` keeps the checkpoint's config.

KV heads. With at least tp_size KV heads, each rank holds its equal part. With fewer (tp 4, 2 KV
heads), a KV head is copied onto the tp_size // num_kv_heads ranks whose query heads read it, as SGLang
does: the KV pool then holds one head per rank, and memory for KV does not shrink below one head.

References: Megatron-LM (Shoeybi et al., 2019); SGLang's models/qwen3.py (QKVParallelLinear,
RowParallelLinear, the KV-head replication of its linear layers).
"""

from __future__ import annotations

from dataclasses import replace


from minioverlap.model.qwen3 import MLP, Attention, Qwen3Config, Qwen3ForCausalLM
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                         VocabParallelEmbedding, features, kv_head_range, shard_range, width)


def check_tp_size(config: Qwen3Config, tp_size: int) -> None:
    """tp_size must divide the query heads and the MLP width, and divide the KV heads or be a multiple of
    them; otherwise a ValueError naming tp_size and the counts. The vocabulary need not divide: it is
    padded (layers.py)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    counts = {"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size}
    bad = [f"{name} ({value})" for name, value in counts.items() if value % tp_size]
    kv = config.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        bad.append(f"num_key_value_heads ({kv}), which it must divide or be a multiple of")
    if bad:
        raise ValueError(f"tp_size ({tp_size}) must divide " + ", ".join(bad)
                         + f" (num_attention_heads {config.num_attention_heads}, num_key_value_heads {kv})")


def rank_config(config: Qwen3Config, tp_rank: int, tp_size: int) -> Qwen3Config:
    """The checkpoint's config as rank tp_rank holds it: its query heads, its KV heads, its MLP width."""
    check_tp_size(config, tp_size)
    return replace(config,
                   num_attention_heads=config.num_attention_heads // tp_size,
                   num_key_value_heads=width(kv_head_range(config.num_key_value_heads, tp_rank, tp_size)),
                   intermediate_size=config.intermediate_size // tp_size)


class TPAttention(Attention):
    """Qwen3's attention over this rank's heads: q, k, v column-parallel by heads, o_proj row-parallel."""

    def __init__(self, config: Qwen3Config, layer_id: int, group: TPGroup) -> None:
        super().__init__(rank_config(config, group.tp_rank, group.tp_size), layer_id)
        hidden, head_dim = config.hidden_size, config.head_dim
        q_heads = shard_range(config.num_attention_heads, group.tp_rank, group.tp_size, "num_attention_heads")
        kv_heads = kv_head_range(config.num_key_value_heads, group.tp_rank, group.tp_size)
        q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        self.q_proj = ColumnParallelLinear(hidden, q_size, group, rows=features(q_heads, head_dim))
        self.k_proj = ColumnParallelLinear(hidden, kv_size, group, rows=features(kv_heads, head_dim))
        self.v_proj = ColumnParallelLinear(hidden, kv_size, group, rows=features(kv_heads, head_dim))
        self.o_proj = RowParallelLinear(q_size, hidden, group, cols=features(q_heads, head_dim))


class TPMLP(MLP):
    """Qwen3's SwiGLU over this rank's columns: gate and up column-parallel, down_proj row-parallel. It asks
    only that tp_size divide the MLP width: DP attention (dp_attention.py) splits this MLP and nothing else."""

    def __init__(self, config: Qwen3Config, group: TPGroup) -> None:
        super().__init__(replace(config, intermediate_size=config.intermediate_size // group.tp_size))
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, group)
        self.up_proj = ColumnParallelLinear(hidden, inner, group)
        self.down_proj = RowParallelLinear(inner, hidden, group)


class TPQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM holding one rank's shard: the same forward(input_ids, positions, ctx) -> hidden
    [T, hidden] and compute_logits(hidden) -> fp32 logits [N, vocab] over the whole vocabulary. Its
    `config` is the rank's view (rank_config); `full_config` the checkpoint's. Build it on the meta
    device and fill it with load_tp_model (parallel/loader.py)."""

    def __init__(self, config: Qwen3Config, group: TPGroup) -> None:
        super().__init__(rank_config(config, group.tp_rank, group.tp_size))
        self.full_config, self.group = config, group
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        for layer_id, layer in enumerate(self.model.layers):      # qwen3's DecoderLayer, its halves sharded
            layer.self_attn = TPAttention(config, layer_id, group)
            layer.mlp = TPMLP(config, group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
