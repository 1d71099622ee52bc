# >>> ch09 file: the verify step's batch, and the KV slots reserved for its window
"""A speculative decode step's batch (TARGET_VERIFY): each request runs a window of k+1 positions, the
bonus token and k drafts, whose KV slots are reserved before the step is built (reserve_kv): from chapter
11 two windows ahead of the host's count. The plain step's batch (engine/forward_batch.py) is the same
ForwardBatch with a window of one.
"""

from __future__ import annotations

# >>> ch10: the window laid out on the device, in a new batch
from dataclasses import replace
# <<< ch10

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.req_to_token import ReqToTokenPool
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode, index_tensors
from minioverlap.engine.request import Req


def window_slack(mtp_steps: int) -> int:
    """KV positions a request may need past its prompt and all but its last new token (prompt +
    max_tokens - 1 positions): none without MTP; with it, as far as its verify windows may reach."""
    # >>> ch11 replaces ch09: two windows from a count of at most prompt + max_tokens - 2 reach 2k+1 past the last token
    #| return mtp_steps
    return 2 * mtp_steps + 1 if mtp_steps else 0
    # <<< ch11
# >>> ch11: two windows


def reservation_end(seq_len: int, kv_len: int, window: int) -> int:
    """Where a request's reserved positions must end before the host builds its next verify step, the
    host counting seq_len committed positions and kv_len reserved. The device may be up to one window
    ahead of the host's count (the step before, in flight, may accept a whole window), and the new
    step writes one more window from wherever that left it: two windows past the count. A reservation
    never shrinks."""
    # >>> exercise 11.1: the reservation arithmetic
    return max(kv_len, seq_len + 2 * window)
    # <<< exercise 11.1
# <<< ch11


def reserve_kv(req: Req, window: int, allocator: PageAllocator, tables: ReqToTokenPool) -> None:
    """Give req a KV slot for every position its next verify may write (pages as needed, their slots into
    req_to_token), without moving seq_len: which of them will hold accepted tokens the step decides."""
    # >>> ch11 replaces ch09: two windows past the host's count, which lags the device by up to one (chapter 12)
    #| start, end = max(req.seq_len, req.kv_len), req.seq_len + window
    start, end = max(req.seq_len, req.kv_len), reservation_end(req.seq_len, req.kv_len, window)
    # <<< ch11
    req.pages += allocator.alloc(allocator.pages_for(end) - len(req.pages))
    if end > start:
        tables.write(req.row, start, allocator.kv_slots(req.pages, start, end))
        req.kv_len = end


def build_verify_batch(reqs: list[Req], window: int, allocator: PageAllocator, tables: ReqToTokenPool,
                       device: str | torch.device) -> ForwardBatch:
    """A speculative decode step: each request runs `window` = k+1 positions, seq_len .. seq_len+k (the
    bonus token and k drafts), all with KV slots reserved. seq_len moves only when the host learns how
    many were accepted."""
    for r in reqs:
        reserve_kv(r, window, allocator, tables)
    prefix_lens, extend_lens, rows = [r.seq_len for r in reqs], [window] * len(reqs), [r.row for r in reqs]
    # >>> ch10 replaces ch09: the step lays its window out on the device, from the relay (resolve_window)
    #| positions, loc, seq_lens = index_tensors(dict(
    #|     positions=[r.seq_len + j for r in reqs for j in range(window)],
    #|     loc=[s for r in reqs for s in allocator.kv_slots(r.pages, r.seq_len, r.seq_len + window)],
    #|     seq_lens=[r.seq_len + window for r in reqs]), device).values()
    positions = loc = seq_lens = None
    # <<< ch10
    indices = dict(req_pool_indices=rows, last_index=[(i + 1) * window - 1 for i in range(len(reqs))],
                   token_rows=[r for r in rows for _ in range(window)])
    return ForwardBatch(
        ForwardMode.TARGET_VERIFY, reqs, positions=positions, out_cache_loc=loc, **index_tensors(indices, device),
        seq_lens=seq_lens, prefix_lens=prefix_lens, extend_lens=extend_lens, rows=rows,
        pages=[p for r in reqs for p in r.pages],
        # >>> ch10 removes ch09: the relay gives them, on the device, when the step runs
        #| draft_inputs=(torch.stack([r.draft[0] for r in reqs]), torch.stack([r.draft[1] for r in reqs])),
        # <<< ch10
        # >>> ch12: the window may start up to one window past the host's count: the step may touch all it reserved
        reach=[r.kv_len for r in reqs],
        # <<< ch12
    )
# >>> ch10: a window laid out on the device, from slot numbers


def resolve_window(batch: ForwardBatch, seq_lens: torch.Tensor, tables: ReqToTokenPool) -> ForwardBatch:
    """A verify step's batch with its positions, KV slots and lengths, computed on the device from each
    request's committed length seq_lens [B] (the relay's): positions L..L+k, their slots in req_to_token."""
    W = batch.extend_lens[0]
    # >>> exercise 10.2: a window from slot numbers
    positions = seq_lens[:, None] + torch.arange(W, device=seq_lens.device)      # [B, W]
    return replace(batch, positions=positions.flatten(), out_cache_loc=tables.kv_slots_at(batch, positions),
                   seq_lens=seq_lens + W)
    # <<< exercise 10.2
# <<< ch10
