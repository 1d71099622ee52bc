# >>> ch02 file: one forward step over the paged cache
"""The model runner: the model and the paged cache it reads and writes, one forward step at a time."""

from __future__ import annotations

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.kv_pool import KVPool
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch08: the checker
from minioverlap.device.hazard import HazardChecker
# <<< ch08
# >>> ch06: the two streams
# >>> ch08 replaces ch06: events
#| from minioverlap.device.streams import Streams
from minioverlap.device.streams import Event, Streams
# <<< ch08
# <<< ch06
from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode, build_batch
from minioverlap.engine.request import Req
# >>> ch03: per-request sampling
from minioverlap.engine.sampler import make_generator
# <<< ch03
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.sampling_params import SamplingParams


class ModelRunner:
    # >>> ch08 replaces ch02: the checker
    #| def __init__(self, model: Qwen3ForCausalLM, *, num_pages: int, page_size: int, max_running: int,
    #|              max_seq_len: int) -> None:
    def __init__(self, model: Qwen3ForCausalLM, *, num_pages: int, page_size: int, max_running: int,
                 max_seq_len: int, hazards: HazardChecker | None = None) -> None:
        # <<< ch08
        c, weight = model.config, model.model.embed_tokens.weight
        self.model, self.device = model, weight.device
        self.allocator = PageAllocator(num_pages, page_size)
        self.kv_pool = KVPool(c.num_hidden_layers, num_pages * page_size, c.num_key_value_heads, c.head_dim,
                              weight.dtype, weight.device)
        self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device)
        # >>> ch06: the two streams
        # >>> ch08 replaces ch06: the checker sees the streams, and every access to the shared tables
        #| self.streams = Streams(self.device)
        self.streams = Streams(self.device, hazards)
        self.hazards = self.tables.hazards = hazards
        self.prompt_on_forward_stream = True     # False: chapter 03's way, the scheduler writes the prompt
        self.shared_read_done: Event | None = None   # recorded by each step once it has read the shared tables
        # <<< ch08
        # <<< ch06

    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        return build_batch(mode, reqs, self.allocator, self.tables, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch; returns the logits [B, vocab] of each request's last token."""
        ctx = PagedAttention(self.kv_pool, self.tables.req_to_token, batch)
        # >>> ch08: a prefill writes its own prompt into token_pool, on the forward stream
        writes_prompt = batch.prompt_tokens is not None and self.prompt_on_forward_stream
        if writes_prompt:
            self.tables.token_pool[batch.token_rows, batch.positions] = batch.prompt_tokens
        # <<< ch08
        # >>> ch03: the inputs, read from token_pool here, in the step's own stream order
        # NOTE: from chapter 06 the previous step's sampler writes these tokens on the forward stream;
        # reading them here, on the same stream, orders the read after the write.
        batch.input_ids = self.tables.token_pool[batch.token_rows, batch.positions].long()
        # <<< ch03
        # >>> ch08: the step has read what it reads of the tables the scheduler writes: the fence opens here
        if self.hazards:
            self.record_table_accesses(batch, writes_prompt)
        self.shared_read_done = self.streams.record()
        # <<< ch08
        hidden = self.model(batch.input_ids, batch.positions, ctx)
        # >>> ch08: the checker
        if self.hazards:
            self.record_kv_accesses(batch)
        # <<< ch08
        return self.model.compute_logits(hidden[batch.last_index])
    # >>> ch08: what a step reads and writes, for the checker

    def record_table_accesses(self, batch: ForwardBatch, writes_prompt: bool) -> None:
        """A step's accesses to the tables the scheduler writes: its prompt (a prefill written here),
        its page table (each row up to its seq_len) and its input tokens."""
        for row, uid, p, n in zip(batch.rows, [r.uid for r in batch.reqs], batch.prefix_lens, batch.extend_lens):
            new = [(row, i) for i in range(p, p + n)]
            if writes_prompt:
                self.hazards.access("token_pool", new, "write", f"the prefill writes request {uid}'s prompt")
            self.hazards.access("req_to_token", [(row, i) for i in range(p + n)], "read",
                                f"attention reads request {uid}'s page table")
            self.hazards.access("token_pool", new, "read", f"the step reads request {uid}'s input tokens")

    def record_kv_accesses(self, batch: ForwardBatch) -> None:
        """Attention writes each new token's K and V, and reads every K and V of its request."""
        for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            slots = self.allocator.kv_slots(req.pages, 0, p + n)
            self.hazards.access("kv_pool", slots[p:], "write", f"attention stores request {req.uid}'s new K and V")
            self.hazards.access("kv_pool", slots, "read", f"attention reads request {req.uid}'s K and V")
    # <<< ch08

    # >>> ch03: request slots for many requests
    def admit(self, req: Req) -> None:
        # >>> ch08 replaces ch03: the prefill step writes the prompt
        #| """Give the request a slot, its own generator if seeded, and its prompt in token_pool."""
        """Give the request a slot and its own generator if seeded (its prefill writes its prompt)."""
        # <<< ch08
        req.row = self.tables.alloc()
        req.generator = make_generator(req, self.device)
        # >>> ch08 fix prompt-on-forward-stream replaces ch03: the prefill step writes the prompt itself, on the forward stream
        #| self.tables.write_tokens(req.row, 0, req.prompt_ids)
        if not self.prompt_on_forward_stream:
            self.tables.write_tokens(req.row, 0, req.prompt_ids)
        # <<< ch08
    # <<< ch03

    def release(self, req: Req) -> None:
        """Give back the request's pages and its request slot."""
        self.allocator.free(req.pages)
        self.tables.free(req.row)
        req.pages, req.row = [], 0


def paged_greedy_generate(runner: ModelRunner, prompt: list[int], max_tokens: int,
                          eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Chapter 01's greedy loop on the paged cache: one request, prefill then one token per step."""
    req = Req(0, list(prompt), SamplingParams(max_tokens), max_tokens, frozenset(eos_token_ids))
    # >>> ch03 replaces ch02: a slot, and the prompt into token_pool
    #| req.row = runner.tables.alloc()
    runner.admit(req)
    # <<< ch03
    try:
        batch = runner.batch(ForwardMode.EXTEND, [req])
        while True:
            req.output_ids.append(int(runner.forward(batch).argmax(dim=-1)))
            # >>> ch03: the next step reads its input from token_pool
            runner.tables.write_tokens(req.row, req.seq_len, req.output_ids[-1:])
            # <<< ch03
            if req.check_stop():
                return req.output_ids
            batch = runner.batch(ForwardMode.DECODE, [req])
    finally:
        runner.release(req)
