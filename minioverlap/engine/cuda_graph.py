# >>> ch13 file: CUDA graphs for the decode step and the verify step
"""CUDA graphs: a decode step's forward pass as one replay instead of hundreds of kernel launches.

A graph records the kernels of one forward pass, with their arguments, once (capture); a replay
launches all of them with one call. What a graph cannot change are its tensors' addresses and shapes,
so each batch size gets its own graph (a bucket), a batch runs in the smallest bucket that holds it,
and its inputs are copied into static buffers that every graph reads:

    input_ids, positions, out_cache_loc, seq_lens   [bucket]
    page_table                                       [bucket, row width]: every column, whatever the lengths

Padded rows (a batch of 5 in the bucket of 8) read token 0 at position 0 through a page table of
zeros, attend to one key, and write their K and V to KV slot 0, which belongs to no request; their
logits are dropped. The step's shared reads (the page table and the input tokens, chapter 08) happen
before the replay, into the static buffers, so the fence's event is recorded before the replay, as
SGLang's runners do when the graph itself reads no shared table. Sampling stays outside the graph:
each request's generator and parameters run eagerly on the replay's logits (nano-vllm and SGLang
also sample after the replay). Prefills change shape every step and run eagerly. With MTP the decode
step is a verify step, captured as three graphs per bucket with the accept rule between them
(minioverlap/speculative/graphs.py).
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.model.qwen3 import Qwen3ForCausalLM

Context = Callable[[torch.Tensor, ForwardBatch], PagedAttention]    # (page_table, batch) -> the runner's context


def capture(device: torch.device, forward: Callable[[], None], pool=None) -> torch.cuda.CUDAGraph:
    """Run `forward` once to warm up (on a side stream, as PyTorch asks), then record it as a graph
    whose memory comes from `pool` (shared by every graph of the engine: they never run at once)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection while recording: a collection may free a dropped engine's graphs, and a
    # graph's destructor is a CUDA call that a capture forbids, which spoils the capture (PyTorch no
    # longer collects before a capture, so such garbage can still be around).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            forward()
    finally:
        if collecting:
            gc.enable()
    return graph


def graph_buckets(max_running: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 below max_running (nano-vllm's spacing: few
    graphs, little padding where batches are small), and max_running itself, so a full batch has one."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_running] + list(range(16, max_running, 16))
    return sorted({*sizes, max_running})


def bucket_for(batch_size: int, buckets: list[int]) -> int:
    """The smallest captured size that holds the batch."""
    return next(b for b in buckets if b >= batch_size)


class StaticInputs:
    """The buffers every graph reads, for up to n rows: a step's inputs are copied in, padded to the bucket."""

    def __init__(self, n: int, width: int, vocab_size: int, table_dtype: torch.dtype, device: torch.device) -> None:
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(n, width, dtype=table_dtype, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)

    def batch(self, b: int) -> ForwardBatch:
        """A decode batch of b rows over the buffers: what every replay of bucket b reads."""
        rows = torch.arange(b, device=self.input_ids.device)
        return ForwardBatch(ForwardMode.DECODE, [], positions=self.positions[:b], out_cache_loc=self.out_cache_loc[:b],
                            req_pool_indices=rows, seq_lens=self.seq_lens[:b], prefix_lens=[0] * b, extend_lens=[1] * b,
                            rows=[0] * b, pages=[], last_index=rows)

    def load(self, batch: ForwardBatch, input_ids: torch.Tensor, page_table: torch.Tensor, b: int) -> None:
        """The step's B rows into the buffers, rows B..b-1 padding: token 0 at position 0, one key
        visible, K and V written to KV slot 0, a page table of zeros (KV slot 0 again)."""
        B, L = page_table.shape
        # >>> exercise 13.1: pad a batch to its bucket
        for static, value, pad in ((self.input_ids, input_ids, 0), (self.positions, batch.positions, 0),
                                   (self.out_cache_loc, batch.out_cache_loc, 0), (self.seq_lens, batch.seq_lens, 1)):
            static[:B] = value
            if B < b:                   # each fill is a launch: none when the batch fills its bucket
                static[B:b] = pad
        self.page_table[:B, :L] = page_table
        if B < b:
            self.page_table[B:b] = 0
        # <<< exercise 13.1


class DecodeGraphs:
    """One captured decode forward per bucket, over one set of static buffers."""

    def __init__(self, model: Qwen3ForCausalLM, context: Context, table: torch.Tensor, max_running: int) -> None:
        """Graphs of `model`'s decode forward through the runner's attention contexts over its KV pool
        (`context`), for page tables as wide as req_to_token (`table`)."""
        self.buckets, device = graph_buckets(max_running), table.device
        self.inputs = StaticInputs(self.buckets[-1], table.shape[1], model.config.vocab_size, table.dtype, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for b in reversed(self.buckets):                 # the largest first: the others reuse its memory
            self.graphs[b] = capture(device, self.forward(model, context, b), pool)
            pool = self.graphs[b].pool()

    def forward(self, model: Qwen3ForCausalLM, context: Context, b: int) -> Callable[[], None]:
        """What bucket b's graph records: the model over its static batch, logits into the buffer."""
        batch, inputs = self.inputs.batch(b), self.inputs
        ctx = context(inputs.page_table[:b], batch)

        def forward() -> None:
            inputs.logits[:b] = model.compute_logits(model(inputs.input_ids[:b], batch.positions, ctx))
        return forward

    def fits(self, batch: ForwardBatch) -> bool:
        """A plain decode step (at most max_running rows, the largest bucket)."""
        return batch.mode is ForwardMode.DECODE

    def replay(self, batch: ForwardBatch, input_ids: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        """The step's inputs into the static buffers, padded to its bucket; one replay -> logits [B, vocab]."""
        b = bucket_for(len(batch.reqs), self.buckets)
        self.inputs.load(batch, input_ids, page_table, b)
        self.graphs[b].replay()
        return self.inputs.logits[:len(batch.reqs)]
