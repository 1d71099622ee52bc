# >>> ch02 file: attention through the page table
"""PagedAttention: the attention context of a ForwardBatch.

The step's page table (each request's row of req_to_token) is read once, when the context is made.
Each layer then writes this step's K and V into the KV pool at `out_cache_loc` and reads every K and V
of each request through the page table:

    EXTEND (ragged prefill): one request at a time, its new queries against its whole sequence;
    DECODE (batched): all requests at once, one query each, against K/V gathered into [B, L] and
                      padded to the longest sequence; positions past a request's length are masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minioverlap.cache.kv_pool import KVPool
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.model.qwen3 import attention


class PagedAttention:
    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, batch: ForwardBatch) -> None:
        """page_table [B, L]: the step's rows of req_to_token, read once before any layer runs (every
        layer reads the same slots); past a request's own length they are stale and never used."""
        self.kv_pool, self.page_table, self.batch = kv_pool, page_table, batch

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention over the step: its new K and V stored first, then read back with the rest."""
        self.store(layer_id, k, v)
        if self.batch.mode is ForwardMode.DECODE:
            return decode_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table,
                                    self.batch.seq_lens)
        # >>> ch09: MTP's verify and draft extend: a window of queries per request, batched
        if self.batch.mode is ForwardMode.TARGET_VERIFY:
            return window_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table,
                                    self.batch.positions)
        # <<< ch09
        return self.extend_attention(layer_id, q)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K and V [T, kv_heads, head_dim] into the pool at their slots (out_cache_loc)."""
        self.kv_pool.store(layer_id, self.batch.out_cache_loc, k, v)

    def extend_attention(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Ragged prefill: request i's queries see its own tokens 0 .. seq_len-1, read through its row."""
        b, out, start = self.batch, [], 0
        for row, prefix, n in zip(self.page_table, b.prefix_lens, b.extend_lens):
            loc = row[:prefix + n]
            k, v = self.kv_pool.k[layer_id][loc], self.kv_pool.v[layer_id][loc]
            out.append(attention(q[start:start + n], k, v, q_start=prefix))
            start += n
        return torch.cat(out)


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
