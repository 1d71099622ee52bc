# >>> ch15 file: the elementwise groups, one kernel each
"""The small kernels between the matrix products, fused: each group reads its inputs once and writes
its outputs once, where PyTorch runs one kernel per operation (and reads and writes every
intermediate in between):

    add_rms_norm   the residual add and the next RMSNorm:   residual += x; out = rmsnorm(residual)
    qk_norm_rope   q/k RMSNorm and RoPE on the fused QKV projection's output, every head of a token
    silu_mul       SwiGLU's silu(gate) * up on the fused gate/up projection's output

One program handles one token (all its heads, for qk_norm_rope). The arithmetic is fp32, as in the
reference (RMSNorm in fp32 whatever the dtype); results are rounded to the model's dtype once, where
the reference rounds after every operation, so in bf16 the two differ by about one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x, residual, weight, out, stride_x, stride_r, stride_o, N, eps,
                        ADD: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    inside = i < N
    h = tl.load(x + token * stride_x + i, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        h += tl.load(residual + token * stride_r + i, mask=inside, other=0.0).to(tl.float32)
        h = h.to(residual.dtype.element_ty)                   # the residual stream keeps the model's dtype
        tl.store(residual + token * stride_r + i, h, mask=inside)
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(weight + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + token * stride_o + i, (h * rstd * w).to(out.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] added into the residual stream, which is then normalised -> (normed [T, N], residual).

    residual=None starts the stream: x itself is the residual (the first layer's input). Otherwise the
    sum is written into `residual` in place, the reference's `x = x + attn(...)` without a new tensor."""
    T, N = x.shape
    out = torch.empty_like(x)
    if T:
        add_rms_norm_kernel[(T,)](x, x if residual is None else residual, weight, out, x.stride(0),
                                  x.stride(0) if residual is None else residual.stride(0), out.stride(0), N, eps,
                                  ADD=residual is not None, BLOCK=triton.next_power_of_2(N))
    return out, x if residual is None else residual


@triton.jit
def qk_norm_rope_kernel(qkv, norm_weight, cos, sin, out, stride_qkv, stride_rope, stride_o, eps,
                        QK_HEADS: tl.constexpr, Q_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                        HALF: tl.constexpr):
    token = tl.program_id(0)
    head = tl.arange(0, HEADS)[:, None]                 # every q and k head of the token: [HEADS, D/2]
    half = tl.arange(0, HALF)[None, :]                  # D/2 padded to a power of two
    real = (head < QK_HEADS) & (half < D // 2)
    src = qkv + token * stride_qkv + head * D           # q heads first, then k heads: head h at h x D
    x1 = tl.load(src + half, mask=real, other=0.0).to(tl.float32)
    x2 = tl.load(src + D // 2 + half, mask=real, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
    w = norm_weight + (head >= Q_HEADS) * D             # [2, D]: q_norm's weight, then k_norm's
    x1 = x1 * rstd * tl.load(w + half, mask=real, other=0.0).to(tl.float32)
    x2 = x2 * rstd * tl.load(w + D // 2 + half, mask=real, other=0.0).to(tl.float32)
    c = tl.load(cos + token * stride_rope + half, mask=half < D // 2)   # cos and sin repeat after D/2 (rope_cos_sin)
    s = tl.load(sin + token * stride_rope + half, mask=half < D // 2)
    dst = out + token * stride_o + head * D
    tl.store(dst + half, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=real)
    tl.store(dst + D // 2 + half, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=real)


def qk_norm_rope(qkv: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_heads: int, kv_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] and k [T, Hkv, D], each head
    RMS-normalised (norm_weight [2, D]: q's, k's) and rotated by its token's angle (cos, sin [T, D], fp32),
    and v [T, Hkv, D], a view of qkv. q and k are views of one [T, Hq + Hkv, D] tensor."""
    T, D = qkv.shape[0], norm_weight.shape[1]
    out = torch.empty(T, q_heads + kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        qk_norm_rope_kernel[(T,)](qkv, norm_weight, cos, sin, out, qkv.stride(0), cos.stride(0), out.stride(0), eps,
                                  QK_HEADS=q_heads + kv_heads, Q_HEADS=q_heads,
                                  HEADS=triton.next_power_of_2(q_heads + kv_heads), D=D,
                                  HALF=triton.next_power_of_2(D // 2))
    v = qkv[:, (q_heads + kv_heads) * D:].view(T, kv_heads, D)
    return out[:, :q_heads], out[:, q_heads:], v


@triton.jit
def silu_mul_kernel(gate_up, out, stride_g, stride_o, N, BLOCK: tl.constexpr):
    token, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    gate = tl.load(gate_up + token * stride_g + i, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up + token * stride_g + N + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + token * stride_o + i, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(N))
    if T:
        silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, gate_up.stride(0), out.stride(0), N, BLOCK=block)
    return out
