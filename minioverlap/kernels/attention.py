# >>> ch15 file: paged decode attention, split over the context
"""Paged attention for the decode step and the verify window, in two kernels (flash-decoding).

A decode step has one query per request, so there is little to spread over the GPU's 132 SMs at
batch 1: one program per (request, KV head) would leave most of them idle while each walks the whole
context. The context is split instead:

    split   grid (B, kv_heads, SPLITS): program (b, h, s) takes request b's queries of every query
            head that shares KV head h (GQA: Hq/Hkv heads, times W window rows), walks its share s of
            the keys 0 .. the window's last position, reading each key's KV slot from the page table,
            and keeps an online softmax (running max m, running sum l, accumulator). It writes its
            partial output acc / l and its log-sum-exp m + log(l).
    merge   grid (T, Hq): the splits of one query head joined, each weighted by exp(lse_s - max lse):
            out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)

A split past a request's end does nothing and has lse = -inf, so it weighs nothing. Reading K and V of
one KV head once for all its query heads is what GQA saves in bandwidth. A window of W queries (MTP's
verify, k+1 rows) is the same kernel with W > 1: each row sees the keys up to its own position.

The reference is `window_attention` in minioverlap/engine/attention.py (decode is W = 1). Scores and the
softmax are computed in fp32, the dot products too (input_precision="ieee"): decode attention is bound
by reading K and V, not by arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32          # keys per iteration of a split's loop
MIN_ROWS = 16         # tl.dot wants at least 16 rows: a group of 4 query heads at W = 1 is padded


@triton.jit
def split_kernel(q, k_pool, v_pool, table, rows, positions, o_part, lse_part, scale,
                 stride_qt, stride_qh, stride_slot, stride_head, stride_table,
                 W: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, ROWS)                          # row r: window row r // GROUP, query head r % GROUP
    real = r < W * GROUP
    token, head = b * W + r // GROUP, kv_head * GROUP + r % GROUP
    d = tl.arange(0, D)
    qs = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=real[:, None], other=0.0).to(tl.float32)
    q_pos = tl.load(positions + token, mask=real, other=-1)
    length = tl.load(positions + b * W + W - 1) + 1                   # keys 0 .. the window's last position
    share = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N       # keys per split, whole blocks
    start = split * share
    stop = tl.minimum(start + share, length)
    row = tl.load(rows + b).to(tl.int64) if HAS_ROWS else b.to(tl.int64)      # request b's row of the table
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < stop
        slot = tl.load(table + row * stride_table + n, mask=inside, other=0).to(tl.int64)
        kv = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        ks = tl.load(k_pool + kv, mask=inside[:, None], other=0.0).to(tl.float32)
        vs = tl.load(v_pool + kv, mask=inside[:, None], other=0.0).to(tl.float32)
        s = tl.dot(qs, tl.trans(ks), input_precision="ieee") * scale                  # [ROWS, BLOCK_N]
        s = tl.where(inside[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row that has seen no key yet
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        acc = acc * alpha[:, None] + tl.dot(p, vs, input_precision="ieee")
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    seen = l > 0                                    # a split past the request's end saw no key
    l = tl.where(seen, l, 1.0)
    part = (token * (tl.num_programs(1) * GROUP) + head) * SPLITS + split     # [T, Hq, SPLITS] layout
    tl.store(o_part + part[:, None] * D + d[None, :], acc / l[:, None], mask=real[:, None])
    tl.store(lse_part + part, tl.where(seen, m + tl.log(l), float("-inf")), mask=real)


@triton.jit
def merge_kernel(o_part, lse_part, out, stride_ot, stride_oh, D: tl.constexpr, SPLITS: tl.constexpr):
    token, head, heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    # >>> exercise 15.2: merge the splits
    lse = tl.load(lse_part + (token * heads + head) * SPLITS + s)
    weight = tl.exp(lse - tl.max(lse, 0))               # split 0 always holds key 0: the max is finite
    parts = tl.load(o_part + ((token * heads + head) * SPLITS + s)[:, None] * D + d[None, :])
    merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    # <<< exercise 15.2
    tl.store(out + token * stride_ot + head * stride_oh + d, merged.to(out.dtype.element_ty))


def num_splits(batch_size: int, kv_heads: int, device: torch.device) -> int:
    """Splits of the context for a batch: on a GPU enough programs to fill an H200's 132 SMs about once
    (batch 1 of an 8B model, 8 KV heads: 16 splits), at most 16, a power of two. In the interpreter,
    which runs one program after another, 2: the fewest that still merge."""
    if device.type != "cuda":
        return 2
    want = max(1, 128 // (batch_size * kv_heads))
    return min(16, 1 << (want.bit_length() - 1))


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor | None, positions: torch.Tensor, window: int,
                    splits: int | None = None) -> torch.Tensor:
    """W = window queries per request, q [B*W, Hq, D] at positions [B*W], each against its request's K and
    V at positions 0 .. its own, read through row rows[b] of the page table `table` -> [B*W, Hq, D].

    The page table is any [rows, L] table of KV slots: req_to_token itself with rows = the requests' rows,
    or the step's own copy of their rows with rows=None (request b reads row b). splits: a power of two
    (None: num_splits's choice for the batch)."""
    T, Hq, D = q.shape
    B, Hkv = T // window, k_pool.shape[1]
    group, splits = Hq // Hkv, splits or num_splits(B, Hkv, q.device)
    assert q.stride(2) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous() and table.stride(1) == 1
    o_part = torch.empty(T, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(T, Hq, splits, dtype=torch.float32, device=q.device)
    split_kernel[(B, Hkv, splits)](
        q, k_pool, v_pool, table, table if rows is None else rows, positions, o_part, lse_part, D ** -0.5,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), table.stride(0),
        W=window, GROUP=group, D=D, ROWS=max(MIN_ROWS, triton.next_power_of_2(window * group)),
        BLOCK_N=BLOCK_N, SPLITS=splits, HAS_ROWS=rows is not None)
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    merge_kernel[(T, Hq)](o_part, lse_part, out, out.stride(0), out.stride(1), D=D, SPLITS=splits)
    return out
