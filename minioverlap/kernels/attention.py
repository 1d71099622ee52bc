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

A split that starts past a request's last key writes only its lse, -inf, so it weighs nothing and the
merge reads no output of it. The number of splits is the device's (num_splits), never the batch's, so a
request's attention does not depend on the batch it shares. With one split there is nothing to merge: the
split kernel writes the output. Reading K and V of one KV head once for all its query heads is what GQA
saves in bandwidth. A window of W queries (MTP's verify, k+1 rows) is the same kernel with W > 1: each
row sees the keys up to its own position. A head_dim that is not a power of two (or is under 16,
tl.dot's least) is padded with masked lanes.

The reference is `window_attention` in minioverlap/engine/attention.py (decode is W = 1). The two dot
products run on the tensor cores in the pool's dtype with fp32 sums (the probabilities rounded to that
dtype for the second, as flash attention does); the scores and the softmax are fp32. An fp32 pool
gets exact fp32 dot products (input_precision="ieee"), which is what its tests compare.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32          # keys per iteration of a split's loop
MIN_ROWS = 16         # tl.dot wants at least 16 rows: a group of 4 query heads at W = 1 is padded


@triton.jit
def split_kernel(q, k_pool, v_pool, table, rows, positions, o_part, lse_part, out, scale,
                 stride_qt, stride_qh, stride_slot, stride_head, stride_table, stride_ot, stride_oh,
                 W: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, ROWS)                          # row r: window row r // GROUP, query head r % GROUP
    real = r < W * GROUP
    token, head = b * W + r // GROUP, kv_head * GROUP + r % GROUP
    d = tl.arange(0, DP)                            # head_dim padded to a power of two >= 16 (tl.dot's least)
    dims = d[None, :] < D
    qs = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=real[:, None] & dims, other=0.0)
    if UPCAST:                                      # the interpreter has no bf16 dot: fp32 holds bf16 exactly
        qs = qs.to(tl.float32)
    q_pos = tl.load(positions + token, mask=real, other=-1)
    length = tl.load(positions + b * W + W - 1) + 1                   # keys 0 .. the window's last position
    share = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N       # keys per split, whole blocks
    start = split * share
    stop = tl.minimum(start + share, length)
    row = tl.load(rows + b).to(tl.int64) if HAS_ROWS else b.to(tl.int64)      # request b's row of the table
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DP], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < stop
        slot = tl.load(table + row * stride_table + n, mask=inside, other=0).to(tl.int64)
        kv = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        ks = tl.load(k_pool + kv, mask=inside[:, None] & dims, other=0.0)
        vs = tl.load(v_pool + kv, mask=inside[:, None] & dims, other=0.0)
        if UPCAST:
            ks, vs = ks.to(tl.float32), vs.to(tl.float32)
        s = tl.dot(qs, tl.trans(ks), input_precision=PRECISION) * scale              # [ROWS, BLOCK_N], fp32
        s = tl.where(inside[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row that has seen no key yet
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        p_dot = p.to(v_pool.dtype.element_ty).to(vs.dtype)                  # rounded as the GPU's dot takes it
        acc = acc * alpha[:, None] + tl.dot(p_dot, vs, input_precision=PRECISION)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    seen = l > 0                                    # a row saw a key in this split (a split past the end: none)
    l = tl.where(seen, l, 1.0)
    if SPLITS == 1:                                 # the whole context in one split: the output itself
        dst = out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, (acc / l[:, None]).to(out.dtype.element_ty), mask=real[:, None] & dims)
    else:                                           # a row that saw no key writes only its lse, -inf
        part = (token * (tl.num_programs(1) * GROUP) + head) * SPLITS + split     # [T, Hq, SPLITS] layout
        tl.store(o_part + part[:, None] * D + d[None, :], acc / l[:, None], mask=(real & seen)[:, None] & dims)
        tl.store(lse_part + part, tl.where(seen, m + tl.log(l), float("-inf")), mask=real)


@triton.jit
def merge_kernel(o_part, lse_part, out, stride_ot, stride_oh, D: tl.constexpr, DP: tl.constexpr,
                 SPLITS: tl.constexpr):
    token, head, heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DP)
    # >>> exercise 15.2: merge the splits
    lse = tl.load(lse_part + (token * heads + head) * SPLITS + s)
    weight = tl.exp(lse - tl.max(lse, 0))               # split 0 always holds key 0: the max is finite
    held = (lse > float("-inf"))[:, None] & (d[None, :] < D)        # a split without keys wrote no output
    parts = tl.load(o_part + ((token * heads + head) * SPLITS + s)[:, None] * D + d[None, :], mask=held, other=0.0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    # <<< exercise 15.2
    tl.store(out + token * stride_ot + head * stride_oh + d, merged.to(out.dtype.element_ty), mask=d < D)


def num_splits(device: torch.device) -> int:
    """Splits of the context: on a GPU 16, enough programs at batch 1 of an 8B model (8 KV heads: 128)
    to reach most of an H200's 132 SMs; in the interpreter, which runs one program after another, 2: the
    fewest that still merge. The count is the device's, never the batch's: a request's keys are then
    summed in the same order whatever batch it shares, and its attention does not depend on its neighbours."""
    return 16 if device.type == "cuda" else 2


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor | None, positions: torch.Tensor, window: int,
                    splits: int | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """W = window queries per request, q [B*W, Hq, D] at positions [B*W], each against its request's K and
    V at positions 0 .. its own, read through row rows[b] of the page table `table` -> [B*W, Hq, D].

    The page table is any [rows, L] table of KV slots: req_to_token itself with rows = the requests' rows,
    or the step's own copy of their rows with rows=None (request b reads row b). splits: a power of two
    (None: num_splits's choice for the device); block_n: keys per iteration, a power of two >= 16."""
    T, Hq, D = q.shape
    B, Hkv = T // window, k_pool.shape[1]
    group, splits = Hq // Hkv, splits or num_splits(q.device)
    DP = max(16, triton.next_power_of_2(D))
    assert q.stride(2) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous() and table.stride(1) == 1
    positions = positions.contiguous()          # read at positions + t: a strided view (MTP's draft rows) is copied
    rows = None if rows is None else rows.contiguous()
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    o_part = torch.empty(T, Hq, splits, D, dtype=torch.float32, device=q.device) if splits > 1 else out
    lse_part = torch.empty(T, Hq, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    split_kernel[(B, Hkv, splits)](
        q, k_pool, v_pool, table, table if rows is None else rows, positions, o_part, lse_part, out, D ** -0.5,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), table.stride(0), out.stride(0), out.stride(1),
        W=window, GROUP=group, D=D, DP=DP, ROWS=max(MIN_ROWS, triton.next_power_of_2(window * group)),
        BLOCK_N=block_n, SPLITS=splits, HAS_ROWS=rows is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",        # tf32: unused by bf16 and fp16 dots
        UPCAST=q.device.type != "cuda")                                 # Triton's interpreter
    if splits > 1:
        merge_kernel[(T, Hq)](o_part, lse_part, out, out.stride(0), out.stride(1), D=D, DP=DP, SPLITS=splits)
    return out
