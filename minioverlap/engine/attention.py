# >>> ch02 file: attention through the page table
# >>> ch18 replaces ch02: one attention call for the whole ragged prefill
#| """PagedAttention: the attention context of a ForwardBatch.
#|
#| The step's page table (each request's row of req_to_token) is read once, when the context is made.
#| Each layer then writes this step's K and V into the KV pool at `out_cache_loc` and reads every K and V
#| of each request through the page table:
#|
#|     EXTEND (ragged prefill): one request at a time, its new queries against its whole sequence;
#|     DECODE (batched): all requests at once, one query each, against K/V gathered into [B, L] and
#|                       padded to the longest sequence; positions past a request's length are masked.
#| """
"""PagedAttention: the attention context of a ForwardBatch.

The step's page table (each request's row of req_to_token) is read once, when the context is made.
Each layer then writes this step's K and V into the KV pool at `out_cache_loc` and reads every K and V
of each request through the page table:

    EXTEND (ragged prefill): all requests at once, in SGLang's ragged layout (ExtendIndices: qo_indptr
                      over the new tokens, kv_indptr and kv_indices over each request's prefix + new
                      tokens), one masked attention for the batch, causal inside the new tokens;
    DECODE (batched): all requests at once, one query each, against K/V gathered into [B, L] and
                      padded to the longest sequence; positions past a request's length are masked.
                      On a CPU the rows go in runs of similar length, each padded to its own longest.
"""
# <<< ch18

from __future__ import annotations

# >>> ch18: the ragged indices, built once a step; on a CPU, decode rows of similar length together
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

# <<< ch18
import torch
import torch.nn.functional as F

from minioverlap.cache.kv_pool import KVPool
# >>> ch18: the ragged indices, built once a step
from minioverlap.device.transfer import to_device_together
# <<< ch18
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
# >>> ch18 removes ch02: the loop over requests called chapter 01's attention
#| from minioverlap.model.qwen3 import attention
# <<< ch18


class PagedAttention:
    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, batch: ForwardBatch) -> None:
        """page_table [B, L]: the step's rows of req_to_token, read once before any layer runs (every
        layer reads the same slots); past a request's own length they are stale and never used."""
        self.kv_pool, self.page_table, self.batch = kv_pool, page_table, batch

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention over the step: its new K and V stored first, then read back with the rest."""
        self.store(layer_id, k, v)
        # >>> ch18 replaces ch02: on a CPU, rows of similar length together: a long prompt's row pads no stream's
        #| if self.batch.mode is ForwardMode.DECODE:
        #|     return decode_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table, self.batch.seq_lens)
        if self.batch.mode is ForwardMode.DECODE:
            return grouped_decode_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table,
                                            self.batch.seq_lens)
        # <<< ch18
        # >>> ch09: MTP's verify and draft extend: a window of queries per request, batched
        if self.batch.mode is ForwardMode.TARGET_VERIFY:
            return window_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table,
                                    self.batch.positions)
        # <<< ch09
        return self.extend_attention(layer_id, q)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K and V [T, kv_heads, head_dim] into the pool at their slots (out_cache_loc)."""
        self.kv_pool.store(layer_id, self.batch.out_cache_loc, k, v)

    # >>> ch18 replaces ch02: one attention call for the whole ragged prefill
    #| def extend_attention(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
    #|     """Ragged prefill: request i's queries see its own tokens 0 .. seq_len-1, read through its row."""
    #|     b, out, start = self.batch, [], 0
    #|     for row, prefix, n in zip(self.page_table, b.prefix_lens, b.extend_lens):
    #|         loc = row[:prefix + n]
    #|         k, v = self.kv_pool.k[layer_id][loc], self.kv_pool.v[layer_id][loc]
    #|         out.append(attention(q[start:start + n], k, v, q_start=prefix))
    #|         start += n
    #|     return torch.cat(out)
    @cached_property
    def extend(self) -> ExtendIndices:
        """The step's ragged indices, built by its first layer and read by every layer after it."""
        return extend_indices(self.batch.prefix_lens, self.batch.extend_lens, self.page_table)

    def extend_attention(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Ragged prefill: request i's queries see its own tokens 0 .. seq_len-1. The requests with several
        new tokens in one masked attention; those with one (a mixed step's decode rows, a chunk of one) in
        one decode attention: padded to the longest request's new tokens, each would cost a long prompt's
        share of the padded call, and a mixed step would cost a prefill per running request."""
        k, v, rows = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.rows
        if rows.one is None:
            return ragged_extend_attention(q, k, v, rows.many)
        out = torch.empty_like(q)
        if rows.many is not None:
            out[rows.many_tokens] = ragged_extend_attention(q[rows.many_tokens], k, v, rows.many)
        out[rows.one_tokens] = decode_attention(q[rows.one_tokens], k, v, self.page_table[rows.one, :rows.one_len],
                                                self.batch.seq_lens[rows.one])
        return out

    @cached_property
    def rows(self) -> RowSplit:
        """The step's requests of one new token and of several, built by the first layer, on the host."""
        return row_split(self.batch.prefix_lens, self.batch.extend_lens, self.page_table)
    # <<< ch18


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor) -> torch.Tensor:
    """One query per request, q [B, Hq, D], against its K/V read through its page table -> [B, Hq, D].

    page_table [B, L] holds each request's KV slots (L >= every seq_len; slots past a request's own
    seq_len are stale). The arithmetic is chapter 01's attention; PyTorch's fused SDPA does it here,
    twice as fast on a CPU as the einsum form, with enable_gqa sharing each KV head among its group
    of query heads. index_select on the flat slot list is pool[page_table], 3x faster on a CPU.
    """
    # >>> exercise 02.1: batched decode attention
    (B, L), slots = page_table.shape, page_table.flatten()
    k = k_pool.index_select(0, slots).view(B, L, *k_pool.shape[1:]).transpose(1, 2)    # [B, Hkv, L, D]
    v = v_pool.index_select(0, slots).view(B, L, *v_pool.shape[1:]).transpose(1, 2)
    visible = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]            # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=True)         # [B, Hq, 1, D]
    return out[:, :, 0]
    # <<< exercise 02.1
# >>> ch18: on a CPU, decode rows of similar length together


CALL_SLOTS = 256   # one more decode_attention call on a CPU, in padded slots: ~40 us, 70 to 500 slots' worth


def grouped_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                             seq_lens: torch.Tensor) -> torch.Tensor:
    """decode_attention over groups of rows of similar length, each padded to its own longest. On a CPU,
    SDPA gathers and computes every padded slot: a step of twelve streams of 400 tokens and one request
    of 800 pads thirteen rows to 800, and the streams pay for the long one in every layer. On a GPU one
    call, as before: reading the lengths there is a synchronisation, a graph replay's shapes cannot
    depend on them, and the fast path's kernel (chapter 15) reads each row's own length."""
    if q.device.type != "cpu":
        return decode_attention(q, k_pool, v_pool, page_table, seq_lens)
    groups = length_groups(tuple(seq_lens.tolist()))      # on a CPU, reading the lengths costs nothing
    if len(groups) == 1:
        return decode_attention(q, k_pool, v_pool, page_table, seq_lens)
    out = torch.empty_like(q)
    for rows, longest in groups:
        ix = torch.tensor(rows, device=q.device)
        out[ix] = decode_attention(q[ix], k_pool, v_pool, page_table[ix, :longest], seq_lens[ix])
    return out


@lru_cache(maxsize=64)
def length_groups(lens: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """The rows, sorted by length, cut into runs that minimize the padded slots (each run's rows x its
    longest) plus CALL_SLOTS a run -> (the rows of each run, its longest). best[j]: the least cost of the
    first j rows. Kept for the step's other layers, which ask again with the same lengths."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + (j - i) * max(lens[order[j - 1]], 1) + CALL_SLOTS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append((order[cut[j]:j], max(lens[order[j - 1]], 1)))
        j = cut[j]
    return groups[::-1]
# <<< ch18
# >>> ch09: a window of queries per request


def window_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """W queries per request, q [B*W, Hq, D] at positions [B*W], each against its request's K/V at
    positions 0 .. its own (causal inside the window) -> [B*W, Hq, D]. Decode is the case W = 1."""
    (B, L), slots = page_table.shape, page_table.flatten()
    W, Hq, D = q.shape[0] // B, q.shape[1], q.shape[2]
    k = k_pool.index_select(0, slots).view(B, L, *k_pool.shape[1:]).transpose(1, 2)    # [B, Hkv, L, D]
    v = v_pool.index_select(0, slots).view(B, L, *v_pool.shape[1:]).transpose(1, 2)
    visible = torch.arange(L, device=q.device)[None, None, :] <= positions.view(B, W)[:, :, None]   # [B, W, L]
    out = F.scaled_dot_product_attention(q.view(B, W, Hq, D).transpose(1, 2), k, v,
                                         attn_mask=visible[:, None], enable_gqa=True)         # [B, Hq, W, D]
    return out.transpose(1, 2).reshape(B * W, Hq, D)
# <<< ch09
# >>> ch18: one attention call for the whole ragged prefill


@dataclass(frozen=True)
class ExtendIndices:
    """A prefill step's ragged layout, SGLang's (triton_ops/extend_attention.py), for B requests:

        qo_indptr  [B+1]  request b's new tokens are q[qo_indptr[b] : qo_indptr[b+1]]
        kv_indptr  [B+1]  its prefix + new tokens are kv_indices[kv_indptr[b] : kv_indptr[b+1]]
        kv_indices [S]    their KV slots, request after request, each in position order
        kv_batch, kv_pos [S]  the request and the position of each entry of kv_indices

    Request b's prefix length is (kv_indptr[b+1] - kv_indptr[b]) - (qo_indptr[b+1] - qo_indptr[b]).
    (SGLang's kv_indptr covers the prefix alone and reads the new K and V from the layer's own tensors;
    here it covers both, as the pool holds both once the layer has stored them.) max_extend and max_kv,
    the longest new part and the longest sequence, are the host's: they size the padding and the grid."""
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_batch: torch.Tensor
    kv_pos: torch.Tensor
    max_extend: int
    max_kv: int


def extend_indices(prefix_lens: list[int], extend_lens: list[int], page_table: torch.Tensor) -> ExtendIndices:
    """The ragged layout from the batch's host lists and the step's page table [B, L] (its rows of
    req_to_token): the index pointers from the host's sizes in one copy, the slot list gathered from the
    page table on the device, without a loop over requests and without reading anything back."""
    # >>> exercise 18.2: the ragged index pointers
    kv_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    ptr = to_device_together({"qo": cumulative(extend_lens), "kv": cumulative(kv_lens), "lens": kv_lens},
                             torch.int64, page_table.device)
    total = sum(kv_lens)
    kv_batch = torch.repeat_interleave(torch.arange(len(kv_lens), device=page_table.device), ptr["lens"],
                                       output_size=total)
    kv_pos = torch.arange(total, device=page_table.device) - ptr["kv"][kv_batch]
    return ExtendIndices(ptr["qo"], ptr["kv"], page_table[kv_batch, kv_pos], kv_batch, kv_pos,
                         max(extend_lens), max(kv_lens))
    # <<< exercise 18.2


@dataclass(frozen=True)
class RowSplit:
    """A prefill step's requests of one new token (`one`: their indices in the batch, None if none;
    `one_tokens`: their token's; `one_len`: the longest of them, the width of their page table: a long
    prompt's chunk in the step does not widen it) and of several (`many`: their ragged layout, None if
    none; `many_tokens`: their tokens)."""
    one: torch.Tensor | None
    one_tokens: torch.Tensor
    one_len: int
    many: ExtendIndices | None
    many_tokens: torch.Tensor


def row_split(prefix_lens: list[int], extend_lens: list[int], page_table: torch.Tensor) -> RowSplit:
    """Split the step's requests by their new tokens, one or several: index lists made on the host (the
    sizes are the host's) and copied in one go."""
    starts = cumulative(extend_lens)
    one = [i for i, n in enumerate(extend_lens) if n == 1]
    many = [i for i, n in enumerate(extend_lens) if n > 1]
    ix = to_device_together({"one": one, "one_tokens": [starts[i] for i in one], "many": many,
                             "many_tokens": [t for i in many for t in range(starts[i], starts[i + 1])]},
                            torch.int64, page_table.device)
    rows = page_table if not one else page_table[ix["many"]]      # all of them: the page table as it is
    layout = extend_indices([prefix_lens[i] for i in many], [extend_lens[i] for i in many], rows) if many else None
    one_len = max((prefix_lens[i] + 1 for i in one), default=0)
    return RowSplit(ix["one"] if one else None, ix["one_tokens"], one_len, layout, ix["many_tokens"])


def cumulative(lens: list[int]) -> list[int]:
    """[0, l0, l0+l1, ...]: the index pointers of a ragged list."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def ragged_extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            ix: ExtendIndices) -> torch.Tensor:
    """Every request's new queries, q [T, Hq, D] laid end to end, against its own prefix + new K and V,
    read from the pool through ix.kv_indices, causal inside the new tokens -> [T, Hq, D].

    One masked attention for the batch: q scattered into [B, M] and K, V into [B, N], padded to
    M = max_extend and N = max_kv; query i of request b (position prefix_b + i) sees key j when j <= prefix_b + i
    and j < its length. What it costs: the padding, B*N slots of K and V (as decode pads to the longest
    sequence), a [B, M, N] mask, and where SDPA computes in full (a CPU's math path) B*Hq*M*N fp32 scores,
    where the loop over requests held one request's Hq*n_b*N at a time; a batch of one long prompt and
    several short ones pays for B long ones. The kernel
    (minioverlap/kernels/extend_attention.py) pads nothing. A padded query row sees keys too, so no row
    is all -inf; its output is never read."""
    T, Hq, D = q.shape
    B = len(ix.qo_indptr) - 1
    q_batch = torch.repeat_interleave(torch.arange(B, device=q.device), ix.qo_indptr.diff(), output_size=T)
    q_row = torch.arange(T, device=q.device) - ix.qo_indptr[q_batch]                   # i: 0 .. n_b - 1
    qp = q.new_zeros(B, ix.max_extend, Hq, D).index_put_((q_batch, q_row), q)
    k = k_pool.new_zeros(B, ix.max_kv, *k_pool.shape[1:]).index_put_((ix.kv_batch, ix.kv_pos),
                                                                     k_pool[ix.kv_indices])
    v = v_pool.new_zeros(B, ix.max_kv, *v_pool.shape[1:]).index_put_((ix.kv_batch, ix.kv_pos),
                                                                     v_pool[ix.kv_indices])
    kv_lens, n = ix.kv_indptr.diff(), ix.qo_indptr.diff()
    q_pos = (kv_lens - n)[:, None] + torch.arange(ix.max_extend, device=q.device)[None, :]   # [B, M]
    j = torch.arange(ix.max_kv, device=q.device)
    visible = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])   # [B, M, N]
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None], enable_gqa=True)     # [B, Hq, M, D]
    return out.transpose(1, 2)[q_batch, q_row]
# <<< ch18
