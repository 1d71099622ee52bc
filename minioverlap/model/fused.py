# >>> ch15 file: the model's fast path
"""The Qwen3 decoder of qwen3.py, through the fused kernels of minioverlap/kernels (chapter 15).

The same weights and the same arithmetic, in fewer kernels. Per layer:

    reference (qwen3.py)                          fast path (this file)
    RMSNorm                                       add_rms_norm       (the residual add fused in)
    q_proj, k_proj, v_proj                        one matrix product (merged at load)
    q_norm, k_norm, RoPE on q and on k            qk_norm_rope       (one kernel, every head)
    K/V store, attention                          Triton store_kv, paged_attention (attention.py)
    o_proj, residual add                          o_proj             (the add goes into the next norm)
    RMSNorm                                       add_rms_norm
    gate_proj, up_proj, SiLU, x                   one matrix product, silu_mul
    down_proj, residual add                       down_proj          (the add goes into the next norm)

The fast path is a pair of classes, picked once at load (engine/backend.py): FusedQwen3ForCausalLM and
FusedMTPLayer are the reference's classes with their forward through these kernels. Loading their
weights (load_state_dict) makes the merged weights once and points the reference's q/k/v and gate/up
weights at slices of them: both paths read the same memory, nothing is stored twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minioverlap.kernels.elementwise import add_rms_norm, qk_norm_rope, silu_mul
from minioverlap.model.mtp import MTPLayer
from minioverlap.model.qwen3 import AttentionContext, Attention, DecoderLayer, MLP, Qwen3ForCausalLM, rope_cos_sin


class MergedAtLoad(nn.Module):
    """Loading the weights (load_state_dict, as the loaders do) also makes the merged ones."""

    def load_state_dict(self, state: dict, *args, **kwargs):
        out = super().load_state_dict(state, *args, **kwargs)
        merge_projections(self)
        return out


class FusedQwen3ForCausalLM(MergedAtLoad, Qwen3ForCausalLM):
    """The Qwen3 decoder with every layer through the fused kernels (fused_layer)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids and positions [T] -> hidden [T, H], as Qwen3ForCausalLM.forward. Each layer hands on its
        MLP output and the residual stream apart: the next norm adds them (add_rms_norm)."""
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = fused_layer(layer, x, residual, cos, sin, ctx)
        return add_rms_norm(x, residual, self.model.norm.weight, c.rms_norm_eps)[0]


class FusedMTPLayer(MergedAtLoad, MTPLayer):
    """The MTP layer (model/mtp.py) with its decoder layer and output norm through the fused kernels."""

    def block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h, residual = fused_layer(self, x, None, cos, sin, ctx)
        return add_rms_norm(h, residual, self.shared_head.norm.weight, self.shared_head.norm.eps)[0]


def merge_projections(model: nn.Module) -> None:
    """Every Attention's q/k/v weights into one `qkv_weight` and its two norms' weights into one
    `qk_norm_weight` [2, D]; every MLP's gate/up into one `gate_up_weight`. The separate weights become
    views of the merged ones."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.qkv_weight = merged(module.q_proj, module.k_proj, module.v_proj)
            module.qk_norm_weight = merged(module.q_norm, module.k_norm).view(2, -1)
        elif isinstance(module, MLP):
            module.gate_up_weight = merged(module.gate_proj, module.up_proj)


def merged(*parts: nn.Module) -> torch.Tensor:
    """The parts' weights end to end along dim 0, in one tensor; each part's weight a view of its rows."""
    weight = torch.cat([p.weight.detach() for p in parts])
    start = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        start += n
    return weight


def fused_layer(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer. x is the last block's output, not yet added to the residual stream (None
    before the first layer, where x is the embedding) -> this layer's MLP output and the stream."""
    attn, mlp, eps = layer.self_attn, layer.mlp, layer.input_layernorm.eps
    h, residual = add_rms_norm(x, residual, layer.input_layernorm.weight, eps)
    q, k, v = qk_norm_rope(F.linear(h, attn.qkv_weight), attn.qk_norm_weight, cos, sin,
                           attn.num_heads, attn.num_kv_heads, attn.q_norm.eps)
    out = ctx.attend(attn.layer_id, q, k, v)
    h, residual = add_rms_norm(attn.o_proj(out.reshape(len(out), -1)), residual,
                               layer.post_attention_layernorm.weight, eps)
    return mlp.down_proj(silu_mul(F.linear(h, mlp.gate_up_weight))), residual
