# >>> ch18 file: extend attention in FlashAttention-2's shape, for a GPU
"""Extend attention at the speed of the matrix units: the same function as chapter 18's `extend_kernel`
(kernels/extend_attention.py: the prefix through the KV index list, the new tokens' K and V from the
layer's tensors, causal inside the new tokens), laid out as FlashAttention-2 lays out a prefill
(Dao, 2023; Triton's fused-attention tutorial). What changes, and why each is worth it on an H100:

    tiles     BLOCK_M = 128 query rows against BLOCK_N = 64 keys: Hopper's warpgroup matrix
              instructions (wgmma) take 64 rows a warpgroup, so a 16-row tile compiles to the older,
              slower mma.sync, and it reads every K and V eight times as often
    masks     only where a tile needs one: the prefix's full blocks and the new keys left of the
              diagonal are visible to every row; the last prefix block (its end) and the diagonal
              blocks (causal) are masked; blocks right of the diagonal are never visited
    softmax   exp2 of scores prescaled by scale * log2(e) (one multiply-add a score instead of a
              multiply and an exp); no branch for a row that has seen no key, since the first block
              of every row shows it at least one
    order     grid (Hq, blocks, B) with the head fastest, so the query heads of a KV group run side by
              side and read the same K and V from L2, and the last (longest: causal) blocks first, so
              the short ones fill the tail
    configs   BLOCK_M, BLOCK_N, warps and pipeline stages per head_dim (CONFIGS), the loads of K and V
              pipelined through shared memory num_stages deep

Numerics as extend_kernel: dots in the pool's dtype with fp32 sums (ieee for fp32), the interpreter's
bf16 upcast to fp32, a head_dim that is no power of two padded with masked lanes. The reference is
`ragged_extend_attention` in minioverlap/engine/attention.py; tools/bench_kernels.py --extend measures it
against chapter 18's kernel and PyTorch's SDPA. The engine's fast path runs it on a GPU
(engine/triton_attention.py); in the interpreter it runs chapter 18's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# head_dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages), any other head_dim DEFAULT_CONFIG: FlashAttention-2's
# Hopper tiles, each compiled for sm_90 without spills; head_dim 128's stages from the sweep of
# `tools/bench_kernels.py --extend --extend-configs ...` on an H200 (chapters/figures/18-h200-extend.json)
CONFIGS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 4)}
DEFAULT_CONFIG = (64, 32, 4, 2)
FP32_CONFIG = (16, 16, 4, 2)    # an fp32 pool (the CUDA suite's): exact dots on the FMA units, which spill larger tiles
LOG2E = 1.4426950408889634


@triton.jit
def flash_extend_kernel(q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, out, qk_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_slot,
                        stride_head, stride_ot, stride_oh,
                        GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    head, b = tl.program_id(0), tl.program_id(2)
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M     # the last blocks (the most keys) first
    q_start = tl.load(qo_indptr + b)
    n_new = tl.load(qo_indptr + b + 1) - q_start
    if m0 >= n_new:                                                 # a short request in a grid for the longest
        return
    kv_start = tl.load(kv_indptr + b)
    prefix = tl.load(kv_indptr + b + 1) - kv_start - n_new
    kv_head = head // GROUP
    i = m0 + tl.arange(0, BLOCK_M)                                  # rows of request b's new tokens
    d = tl.arange(0, DP)
    token = (q_start + i).to(tl.int64)
    qs = load(q + token[:, None] * stride_qt + head * stride_qh + d[None, :], i < n_new, d, D, DP, True)
    if UPCAST:                                                      # the interpreter has no bf16 dot
        qs = qs.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    pool = kv_head * stride_head + d[None, :]
    # the prefix, through the KV index list: its full blocks unmasked, then its last, partial block
    full = prefix - prefix % BLOCK_N
    for n0 in range(0, full, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(kv_indices + kv_start + n).to(tl.int64)[:, None] * stride_slot + pool
        ks = load(k_pool + slot, n < prefix, d, D, DP, False)
        vs = load(v_pool + slot, n < prefix, d, D, DP, False)
        m, l, acc = online_softmax(qs, ks, vs, n[None, :] < prefix, m, l, acc, qk_scale, False, PRECISION, UPCAST)
    if full < prefix:
        n = full + tl.arange(0, BLOCK_N)
        slot = tl.load(kv_indices + kv_start + n, mask=n < prefix, other=0).to(tl.int64)[:, None] * stride_slot + pool
        ks = load(k_pool + slot, n < prefix, d, D, DP, True)
        vs = load(v_pool + slot, n < prefix, d, D, DP, True)
        m, l, acc = online_softmax(qs, ks, vs, n[None, :] < prefix, m, l, acc, qk_scale, True, PRECISION, UPCAST)
    # the new tokens left of the diagonal (keys 0 .. m0-1): every one visible to every row
    for n0 in range(0, m0, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        t = (q_start + n).to(tl.int64)[:, None]
        ks = load(k + t * stride_kt + kv_head * stride_kh + d[None, :], n < n_new, d, D, DP, False)
        vs = load(v + t * stride_vt + kv_head * stride_vh + d[None, :], n < n_new, d, D, DP, False)
        m, l, acc = online_softmax(qs, ks, vs, n[None, :] <= i[:, None], m, l, acc, qk_scale, False, PRECISION,
                                   UPCAST)
    # the diagonal blocks (keys m0 .. the block's last row): causal
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, n_new), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        t = (q_start + n).to(tl.int64)[:, None]
        ks = load(k + t * stride_kt + kv_head * stride_kh + d[None, :], n < n_new, d, D, DP, True)
        vs = load(v + t * stride_vt + kv_head * stride_vh + d[None, :], n < n_new, d, D, DP, True)
        m, l, acc = online_softmax(qs, ks, vs, n[None, :] <= i[:, None], m, l, acc, qk_scale, True, PRECISION,
                                   UPCAST)
    dst = out + token[:, None] * stride_ot + head * stride_oh + d[None, :]
    rows = i < n_new
    if DP > D:
        tl.store(dst, (acc / l[:, None]).to(out.dtype.element_ty), mask=rows[:, None] & (d[None, :] < D))
    else:
        tl.store(dst, (acc / l[:, None]).to(out.dtype.element_ty), mask=rows[:, None])


@triton.jit
def load(ptrs, rows, d, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    """A [rows, DP] tile, masked only where it must be: rows past the end (ROWS), lanes past D (DP > D).
    An unmasked load is a plain 16-byte one; a mask along the rows keeps it so."""
    if ROWS and DP > D:
        x = tl.load(ptrs, mask=rows[:, None] & (d[None, :] < D), other=0.0)
    elif ROWS:
        x = tl.load(ptrs, mask=rows[:, None], other=0.0)
    elif DP > D:
        x = tl.load(ptrs, mask=d[None, :] < D, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def online_softmax(qs, ks, vs, visible, m, l, acc, qk_scale, MASK: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """One block of keys into each row's running max m, sum l and accumulator acc, in base 2: the scores
    times qk_scale = scale * log2(e), so exp2 of them is exp of the scaled ones. `visible` is applied
    only where MASK says the block needs it."""
    if UPCAST:
        ks, vs_dot = ks.to(tl.float32), vs.to(tl.float32)
    else:
        vs_dot = vs
    s = tl.dot(qs, tl.trans(ks), input_precision=PRECISION)                     # [BLOCK_M, BLOCK_N], fp32
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    p_dot = p.to(vs.dtype).to(vs_dot.dtype)                         # rounded as the GPU's dot takes it
    acc = tl.dot(p_dot, vs_dot, acc * alpha[:, None], input_precision=PRECISION)      # accumulated in place
    return m_new, l * alpha + tl.sum(p, 1), acc


def flash_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, max_extend: int,
                           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """extend_attention's arguments and result (kernels/extend_attention.py): every request's new queries
    q [T, Hq, D] against its prefix in the pool and its own new K and V (k, v [T, Hkv, D]), causal inside
    the new tokens -> [T, Hq, D]. config: (BLOCK_M, BLOCK_N, num_warps, num_stages), by default the
    head_dim's from CONFIGS (fp32: FP32_CONFIG); BLOCK_M a multiple of BLOCK_N."""
    T, Hq, D = q.shape
    B = len(qo_indptr) - 1
    default = FP32_CONFIG if q.dtype == torch.float32 else CONFIGS.get(D, DEFAULT_CONFIG)
    block_m, block_n, warps, stages = config or default
    assert block_m % block_n == 0, f"BLOCK_M {block_m} must be a multiple of BLOCK_N {block_n}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    flash_extend_kernel[(Hq, triton.cdiv(max_extend, block_m), B)](
        q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices.contiguous(), out, D ** -0.5 * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        GROUP=Hq // k_pool.shape[1], D=D, DP=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type != "cuda", num_warps=warps, num_stages=stages)
    return out
