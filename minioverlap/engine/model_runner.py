# >>> ch02 file: one forward step over the paged cache
"""The model runner: the model and the paged cache it reads and writes, one forward step at a time."""

from __future__ import annotations

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.kv_pool import KVPool
from minioverlap.cache.req_to_token import ReqToTokenPool
from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode, build_batch
from minioverlap.engine.request import Req
# >>> ch03: per-request sampling
from minioverlap.engine.sampler import make_generator
# <<< ch03
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, *, num_pages: int, page_size: int, max_running: int,
                 max_seq_len: int) -> None:
        c, weight = model.config, model.model.embed_tokens.weight
        self.model, self.device = model, weight.device
        self.allocator = PageAllocator(num_pages, page_size)
        self.kv_pool = KVPool(c.num_hidden_layers, num_pages * page_size, c.num_key_value_heads, c.head_dim,
                              weight.dtype, weight.device)
        self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device)

    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        return build_batch(mode, reqs, self.allocator, self.tables, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch; returns the logits [B, vocab] of each request's last token."""
        ctx = PagedAttention(self.kv_pool, self.tables.req_to_token, batch)
        # >>> ch03: the inputs, read from token_pool here, in the step's own stream order
        # NOTE: from chapter 06 the previous step's sampler writes these tokens on the forward stream;
        # reading them here, on the same stream, orders the read after the write.
        batch.input_ids = self.tables.token_pool[batch.token_rows, batch.positions].long()
        # <<< ch03
        hidden = self.model(batch.input_ids, batch.positions, ctx)
        return self.model.compute_logits(hidden[batch.last_index])

    # >>> ch03: request slots for many requests
    def admit(self, req: Req) -> None:
        """Give the request a slot, its own generator if seeded, and its prompt in token_pool."""
        req.row = self.tables.alloc()
        req.generator = make_generator(req, self.device)
        self.tables.write_tokens(req.row, 0, req.prompt_ids)
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
