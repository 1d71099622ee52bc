"""The Qwen3 decoder in plain PyTorch.

One file, top to bottom: the configuration, RMSNorm, rotary position embedding (RoPE), grouped-query
attention with QK-norm, the SwiGLU MLP, the decoder layer, and the model with its LM head.

The model never sees a batch dimension. Its input is a flat list of tokens, `input_ids[T]` with their
`positions[T]`, and every layer works on `[T, hidden]`. How the tokens group into requests, and where
their keys and values live, is the business of an attention context (`ctx`) passed in by the caller:
the layer computes q, k and v, then hands them to `ctx.attend(layer_id, q, k, v)`. Chapter 01's context
is a contiguous cache for one request; chapter 02's reads a paged cache. The layers stay the same.

References: Qwen3 technical report (2025); transformers' modeling_qwen3.py, whose weight names
this file keeps so a checkpoint loads by name; RoFormer (Su et al., 2021) for RoPE; GQA (Ainslie et
al., 2023); Llama (Touvron et al., 2023) for RMSNorm + SwiGLU in a pre-norm decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Qwen3Config:
    vocab_size: int = 4096             # tokens in the vocabulary
    hidden_size: int = 256             # width of the residual stream
    intermediate_size: int = 768       # width of the MLP's hidden layer
    num_hidden_layers: int = 6         # decoder layers
    num_attention_heads: int = 4       # query heads
    num_key_value_heads: int = 2       # key/value heads, shared by groups of query heads (GQA)
    head_dim: int = 64                 # width of one head (Qwen3 sets it apart from hidden/heads)
    rms_norm_eps: float = 1e-6         # added to the mean square in RMSNorm
    rope_theta: float = 10000.0        # base of RoPE's frequencies
    max_position_embeddings: int = 1024  # the context length the model was built for
    tie_word_embeddings: bool = True   # the LM head reuses the embedding matrix
    eos_token_ids: tuple[int, ...] = ()  # tokens that end a completion
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers (chapter 09)


class AttentionContext(Protocol):
    """What a layer needs from the caller: somewhere to keep K/V, and attention over it."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] of this step's tokens -> output [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of x [..., dim] normalised, in fp32 arithmetic, returned in x's dtype."""
        # >>> ch14 replaces ch01: PyTorch's fused kernel, the same arithmetic in one launch instead of eight
        #| dtype = x.dtype
        #| x = x.float()
        #| x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        #| return self.weight * x.to(dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # <<< ch14


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for each position: pair i turns at frequency theta^(-2i/head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x [T, H, D] by its token's angle: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    # >>> exercise 01.1: rotary embedding
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin
    # <<< exercise 01.1


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Causal grouped-query attention for one sequence.

    q [T, Hq, D] holds the queries of positions q_start .. q_start+T-1; k and v [S, Hkv, D] hold the
    keys and values of positions 0 .. S-1 (S = q_start + T). Query head h reads key/value head
    h // (Hq // Hkv). Returns [T, Hq, D].
    """
    # >>> exercise 01.2: grouped-query attention
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                       # [S, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    q_pos = torch.arange(q_start, q_start + q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return torch.einsum("hts,shd->thd", probs, v)
    # <<< exercise 01.2


class Attention(nn.Module):
    """Self-attention with GQA and QK-norm (an RMSNorm over each head of q and k, before RoPE)."""

    def __init__(self, config: Qwen3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attend(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: Qwen3Config, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """Embedding, the decoder layers, and the final norm."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """The decoder plus the LM head. forward() returns hidden states; compute_logits() the scores."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids and positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        # >>> ch14: cast once a step, not in every layer's apply_rope (two launches each, for q and for k)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # <<< ch14
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], in fp32 so that sampling sees exact scores."""
        return self.lm_head(hidden).float()
