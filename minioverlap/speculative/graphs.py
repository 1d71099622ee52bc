# >>> ch13 file: CUDA graphs for the verify step
"""With MTP (chapter 09) a decode step is a verify step: three passes, one graph each per bucket, over
buffers of their own (engine/cuda_graph.py captures the plain decode step and holds what both share:
capture, the buckets, the attention contexts' type).
"""

from __future__ import annotations

from typing import Callable

import torch

from minioverlap.engine.cuda_graph import Context, bucket_for, capture, graph_buckets
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.attention import PagedAttention


def pad_into(static: torch.Tensor, value: torch.Tensor, size: int, pad: float | torch.Tensor) -> None:
    """value into the first rows of a static buffer, `pad` into the rest of its first `size` rows."""
    static[:len(value)] = value
    if len(value) < size:
        static[len(value):size] = pad


class SpecGraphs:
    """With MTP (chapter 09) a decode step is a verify step: three passes, one graph each per bucket.

        draft          the k-1 MTP passes           buffers: the window's layout, the relay's d1 and hidden
        target         the target over the windows  + the window's tokens, read from token_pool
        draft extend   the MTP layer over them      + the accepted tokens and the last accepted rows

    The graphs offer the eager passes' methods (SpecRunner.draft, target, extend_rows), with the same
    arguments, so a verify step runs either without telling them apart. Between the replays the step's
    glue runs eagerly, exactly as in an eager step: the drafts into token_pool, the verify's inputs read
    back, the LM head and the accept rule (a sampled request draws from its own generator), the window
    into token_pool, the relay; and the draft extend reads the page table itself, before its replay, so
    the fence's event still follows the step's last shared read (chapter 12). A bucket of b requests
    holds b*W window rows (W = k+1); a padded request's W rows read token 0 at position 0 and write KV
    slot 0, as a padded decode row does."""

    def __init__(self, draft: Callable, target: Callable, extend_rows: Callable, *, context: Context,
                 table: torch.Tensor, hidden: torch.Tensor, window: int, max_running: int) -> None:
        """Graphs of the three eager passes through the runner's attention contexts (`context`), for page tables as wide as req_to_token
        (`table`) and MTP hidden states like the relay's (`hidden`)."""
        self.buckets, self.window = graph_buckets(max_running), window
        n, W, dev = self.buckets[-1], window, table.device
        self.input_ids, self.next_ids, self.positions, self.out_cache_loc = (
            torch.zeros(n * W, dtype=torch.int64, device=dev) for _ in range(4))
        self.seq_lens = torch.full((n,), W, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(n, table.shape[1], dtype=table.dtype, device=dev)
        self.draft_token, self.first = torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros_like(self.seq_lens)
        self.draft_hidden, self.next_hidden = torch.zeros_like(hidden[:n]), torch.zeros_like(hidden[:n])
        self.pad_last = torch.arange(n, device=dev) * W          # a padded request's last row: its first
        self.last = self.pad_last.clone()
        self.drafts = torch.zeros(n, W - 1, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(n * W, hidden.shape[1], dtype=hidden.dtype, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ...]] = {}
        pool = None
        for b in reversed(self.buckets):
            passes = self.passes(b, context(self.page_table[:b], self.batch(b)), draft, target, extend_rows)
            self.graphs[b] = tuple(capture(dev, forward, pool) for forward in passes)
            pool = self.graphs[b][0].pool()

    def batch(self, b: int) -> ForwardBatch:
        """A verify batch of b requests over the buffers: what bucket b's graphs read."""
        W, rows = self.window, torch.arange(b, device=self.seq_lens.device)
        return ForwardBatch(ForwardMode.TARGET_VERIFY, [None] * b, positions=self.positions[:b * W],
                            out_cache_loc=self.out_cache_loc[:b * W], req_pool_indices=rows, seq_lens=self.seq_lens[:b],
                            prefix_lens=[0] * b, extend_lens=[W] * b, rows=[0] * b, pages=[],
                            last_index=self.pad_last[:b] + W - 1)

    def passes(self, b: int, ctx: PagedAttention, draft: Callable, target: Callable,
               extend_rows: Callable) -> tuple[Callable[[], None], ...]:
        """What bucket b's three graphs record: chapter 09's passes over the buffers."""
        batch, W = ctx.batch, self.window

        def draft_pass() -> None:
            self.drafts[:b] = draft(batch, ctx, (self.draft_token[:b], self.draft_hidden[:b]))

        def target_pass() -> None:
            self.hidden[:b * W] = target(batch, self.input_ids[:b * W], ctx)

        def extend_pass() -> None:
            self.first[:b], self.next_hidden[:b] = extend_rows(batch, self.next_ids[:b * W], self.hidden[:b * W],
                                                               self.last[:b], self.page_table[:b])
        return draft_pass, target_pass, extend_pass

    def fits(self, batch: ForwardBatch) -> bool:
        """A verify step (at most max_running requests, the largest bucket)."""
        return batch.mode is ForwardMode.TARGET_VERIFY

    def draft(self, batch: ForwardBatch, ctx: PagedAttention, draft_inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The step's layout into the buffers, padded to its bucket, and the draft passes -> drafts [B, k]."""
        B, W, b = len(batch.reqs), self.window, bucket_for(len(batch.reqs), self.buckets)
        token, hidden = draft_inputs
        for static, value, size, pad in ((self.positions, batch.positions, b * W, 0),
                                         (self.out_cache_loc, batch.out_cache_loc, b * W, 0),
                                         (self.seq_lens, batch.seq_lens, b, W),
                                         (self.draft_token, token, b, 0), (self.draft_hidden, hidden, b, 0)):
            pad_into(static, value, size, pad)
        self.load_page_table(ctx.page_table, b)
        self.graphs[b][0].replay()
        return self.drafts[:B]

    def target(self, batch: ForwardBatch, input_ids: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
        """The window's tokens into the buffers and the target's pass -> hidden states [B*W, hidden] (the
        layout and the page table are in the buffers since the draft)."""
        b, T = bucket_for(len(batch.reqs), self.buckets), len(input_ids)
        pad_into(self.input_ids, input_ids, b * self.window, 0)
        self.graphs[b][1].replay()
        return self.hidden[:T]

    def extend_rows(self, batch: ForwardBatch, next_ids: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor,
                    page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The accepted tokens, each request's last accepted row and the page table the draft extend
        read, into the buffers (the target's hidden states are there since its replay); the draft
        extend -> next first drafts [B] and their hidden states."""
        B, b = len(batch.reqs), bucket_for(len(batch.reqs), self.buckets)
        pad_into(self.next_ids, next_ids, b * self.window, 0)
        pad_into(self.last, last, b, self.pad_last[B:b])
        self.load_page_table(page_table, b)
        self.graphs[b][2].replay()
        return self.first[:B], self.next_hidden[:B]

    def load_page_table(self, page_table: torch.Tensor, b: int) -> None:
        """The step's rows of req_to_token into the buffer; rows B..b-1 point at KV slot 0 only."""
        B, L = page_table.shape
        self.page_table[:B, :L] = page_table
        self.page_table[B:b] = 0
