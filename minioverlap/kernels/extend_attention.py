# >>> ch18 file: one attention kernel for a ragged prefill
"""Extend attention for a whole prefill step in one kernel, in the shape of SGLang's `_fwd_kernel`
(python/sglang/srt/layers/attention/triton_ops/extend_attention.py), written anew for this engine.

A prefill step holds B requests, each with a cached prefix (chapter 17's tree, or none) and n_b new
tokens, the new tokens laid end to end (ExtendIndices in minioverlap/engine/attention.py):

    grid (B, Hq, ceil(max_extend / BLOCK_M))   program (b, h, m) takes rows m*BLOCK_M .. of request b's
            new queries for query head h, and keeps an online softmax (running max, sum, accumulator)
    prefix  keys 0 .. prefix_b - 1, their KV slots read from kv_indices[kv_indptr[b] ..]: every one is
            visible to every new query, so no mask but the end
    new     the new tokens' K and V read from the layer's own tensors (k, v [T, Hkv, D]) at
            qo_indptr[b] .., up to the block's last row: causal, key i visible to query i' when i <= i'

A program whose rows all lie past n_b (a short request in a grid sized for the longest) masks every
row and stores nothing. One launch a layer, whatever the number of requests. The arithmetic is that of
split_kernel (kernels/attention.py): the dots in the pool's dtype with fp32 sums, exact fp32 dots for an
fp32 pool (input_precision="ieee"), the interpreter's bf16 upcast to fp32; a head_dim that is not a power
of two (or is under 16) padded with masked lanes. The reference is `ragged_extend_attention` in
minioverlap/engine/attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16          # new queries per program (tl.dot's least rows)
BLOCK_N = 32          # keys per iteration


@triton.jit
def extend_kernel(q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, out, scale,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                  stride_ot, stride_oh,
                  GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    b, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qo_indptr + b)
    n_new = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    prefix = tl.load(kv_indptr + b + 1) - kv_start - n_new
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)                 # rows of request b's new tokens
    rows = i < n_new
    d = tl.arange(0, DP)
    dims = d[None, :] < D
    token = (q_start + i).to(tl.int64)
    qs = tl.load(q + token[:, None] * stride_qt + head * stride_qh + d[None, :], mask=rows[:, None] & dims, other=0.0)
    if UPCAST:                                                  # the interpreter has no bf16 dot
        qs = qs.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    # the prefix, through the KV index list: every key visible to every row
    for n0 in range(0, prefix, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < prefix
        slot = tl.load(kv_indices + kv_start + n, mask=inside, other=0).to(tl.int64)
        kv = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        ks = tl.load(k_pool + kv, mask=inside[:, None] & dims, other=0.0)
        vs = tl.load(v_pool + kv, mask=inside[:, None] & dims, other=0.0)
        m, l, acc = online_softmax(qs, ks, vs, rows[:, None] & inside[None, :], m, l, acc, scale,
                                   PRECISION, UPCAST)
    # the new tokens, from the layer's own K and V: causal
    end = tl.minimum(n_new, (block + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < end
        t = (q_start + n).to(tl.int64)[:, None]
        ks = tl.load(k + t * stride_kt + kv_head * stride_kh + d[None, :], mask=inside[:, None] & dims, other=0.0)
        vs = tl.load(v + t * stride_vt + kv_head * stride_vh + d[None, :], mask=inside[:, None] & dims, other=0.0)
        causal = rows[:, None] & inside[None, :] & (n[None, :] <= i[:, None])
        m, l, acc = online_softmax(qs, ks, vs, causal, m, l, acc, scale, PRECISION, UPCAST)
    l = tl.where(l > 0, l, 1.0)                                 # a row past n_new saw no key
    dst = out + token[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, (acc / l[:, None]).to(out.dtype.element_ty), mask=rows[:, None] & dims)


@triton.jit
def online_softmax(qs, ks, vs, visible, m, l, acc, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One block of keys into the running max m, sum l and accumulator acc of each row."""
    if UPCAST:
        ks, vs_dot = ks.to(tl.float32), vs.to(tl.float32)
    else:
        vs_dot = vs
    s = tl.dot(qs, tl.trans(ks), input_precision=PRECISION) * scale             # [BLOCK_M, BLOCK_N], fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)         # a row that has seen no key yet
    p = tl.exp(s - base[:, None])
    alpha = tl.exp(m - base)
    p_dot = p.to(vs.dtype).to(vs_dot.dtype)                     # rounded as the GPU's dot takes it
    acc = acc * alpha[:, None] + tl.dot(p_dot, vs_dot, input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, 1), acc


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, max_extend: int, block_m: int = BLOCK_M,
                     block_n: int = BLOCK_N) -> torch.Tensor:
    """Every request's new queries q [T, Hq, D] against its prefix (its slots kv_indices[kv_indptr[b] ..],
    in the pool) and its own new K and V (k, v [T, Hkv, D], laid out as q), causal inside the new
    tokens -> [T, Hq, D]; k and v may be views of different strides (the fast path's: v a slice of the
    merged projection, k the normed and rotated copy). max_extend: the longest new part (the host's), which
    sizes the grid."""
    T, Hq, D = q.shape
    B = len(qo_indptr) - 1
    DP = max(16, triton.next_power_of_2(D))
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    extend_kernel[(B, Hq, triton.cdiv(max_extend, block_m))](
        q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices.contiguous(), out, D ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        GROUP=Hq // k_pool.shape[1], D=D, DP=DP, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type != "cuda")
    return out
