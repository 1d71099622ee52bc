# >>> ch02 file: one forward step over the paged cache
"""The model runner: the model and the paged cache it reads and writes, one step at a time.

From chapter 04 one step is the runner's whole job: `launch` runs the forward pass, samples, leaves each
token on the device for the next step (05), starts copying the tokens to the host and returns the
launched step; `wait` blocks until its tokens are on the host. The scheduler decides what runs and
handles the results; it reaches the device only through the runner's methods.
"""

from __future__ import annotations

# >>> ch13: CUDA graphs
from collections.abc import Callable
from functools import partial
# <<< ch13

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.kv_pool import KVPool, check_memory, default_pages
# >>> ch21: the pool sized by what is given
from minioverlap.cache.kv_pool import check_holds_a_context, gib, pool_pages
# <<< ch21
from minioverlap.cache.manager import CacheManager
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch08: the guards and the checker
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardChecker
from minioverlap.device.streams import Event
# <<< ch08
# >>> ch06: the two streams
from minioverlap.device.streams import Streams
# <<< ch06
# >>> ch04: a launched step
from minioverlap.device.transfer import to_host
from minioverlap.engine.step import StepOutput
# <<< ch04
from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode, build_batch
from minioverlap.engine.request import Req
from minioverlap.engine.slots import SlotsMixin
# >>> ch03: per-request sampling
from minioverlap.engine.sampler import sample
# <<< ch03
# >>> ch16: repetition_penalty and min_tokens, from what the device holds
from minioverlap.engine.sampler import penalized
# <<< ch16
from minioverlap.model.qwen3 import Qwen3ForCausalLM
# >>> ch13: CUDA graphs
from minioverlap.engine.cuda_graph import DecodeGraphs
# <<< ch13
# >>> ch16: logprobs, computed with the sample
from minioverlap.engine.logprobs import StepLogprobs, TokenLogprob, step_logprobs
# <<< ch16

class ModelRunner(SlotsMixin):
    """The model and the device state a step touches, one step at a time."""
    # >>> ch13: no graphs unless init_graphs captures them
    graphs: DecodeGraphs | None = None
    # <<< ch13
    # >>> ch16: the logprobs of the step being launched (None: no request asked), until run hands them to it
    logprobs: StepLogprobs | None = None
    # <<< ch16

    def __init__(self, model: Qwen3ForCausalLM, *, num_pages: int | None, page_size: int, max_running: int,
                 max_seq_len: int,
                 # >>> ch08: the guards, and the checker, given to everything that records accesses
                 guards: Guards = Guards(), hazards: HazardChecker | None = None,
                 # <<< ch08
                 # >>> ch15: the attention context's class, chosen once at load (the fast path's, or PagedAttention)
                 attention: type[PagedAttention] = PagedAttention,
                 # <<< ch15
                 # >>> ch21: what sizes the pool without num_pages: max_total_tokens, or the bytes mem_fraction_static leaves
                 max_total_tokens: int | None = None,
                 pool_bytes: int | None = None,
                 # <<< ch21
                 ) -> None:
        """The runner owns the model and everything a step touches on the device: the KV pool, the page
        allocator and the request tables (chapter 02), sized here (num_pages=None: enough pages for every
        request slot to hold max_seq_len tokens; from chapter 21, if given, what max_total_tokens or the
        memory left allows: size_pool), and the two streams (06). From chapter 08 it also holds
        the guards and the hazard checker, which it gives to everything that records accesses. A request's
        slot and pages are the cache manager's (`self.cache`). Nothing above the runner touches a device
        table."""
        c, weight = model.config, model.model.embed_tokens.weight
        self.model, self.device = model, weight.device
        # >>> ch21: without num_pages, sized by max_total_tokens or by the memory left; with neither, as before
        if num_pages is None:
            num_pages = self.size_pool(max_total_tokens, pool_bytes, page_size, max_running, max_seq_len)
        # <<< ch21
        num_pages = default_pages(max_running, max_seq_len, page_size) if num_pages is None else num_pages
        check_memory(num_pages, page_size, self.token_bytes(), max_running, max_seq_len, str(weight.device))
        self.allocator = PageAllocator(num_pages, page_size)
        self.kv_pool = KVPool(c.num_hidden_layers, num_pages * page_size, c.num_key_value_heads, c.head_dim,
                              weight.dtype, weight.device)
        # >>> ch15: the fast path
        self.attention_class = attention
        # <<< ch15
        # >>> ch08 replaces ch02: the guards; the checker sees every access to the tables
        #| self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device)
        self.guards, self.hazards = guards, hazards
        self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device, hazards)
        # <<< ch08
        self.cache = CacheManager(self.allocator, self.tables)
        # >>> ch06: the two streams
        # >>> ch08 replaces ch06: the checker sees the streams
        #| self.streams = Streams(self.device)
        self.streams = Streams(self.device, hazards)
        # <<< ch08
        # <<< ch06
    # >>> ch21: the pool sized by what is given

    def size_pool(self, max_total_tokens: int | None, pool_bytes: int | None, page_size: int, max_running: int,
                  max_seq_len: int) -> int | None:
        """The pages of a pool that max_total_tokens or the bytes mem_fraction_static leaves size
        (kv_pool.pool_pages); None: neither is given. Such a pool must hold one whole max_seq_len context
        (a pool of num_pages is the caller's to size: a request too large for it is refused as it comes)."""
        if max_total_tokens is None and pool_bytes is None:
            return None
        pages = pool_pages(default_pages(max_running, max_seq_len, page_size), page_size, page_size * self.token_bytes(),
                           max_total_tokens=max_total_tokens, pool_bytes=pool_bytes)
        if max_total_tokens is not None:
            check_holds_a_context(pages, page_size, max_seq_len, f"max_total_tokens={max_total_tokens}",
                                  "max_total_tokens")
        else:
            check_holds_a_context(pages, page_size, max_seq_len, f"mem_fraction_static, whose share less what is in "
                                  f"use leaves {gib(pool_bytes)} for the KV pool,", "mem_fraction_static")
        return pages

    @property
    def pool_tokens(self) -> int:
        """The tokens the pool holds (page 0 is never handed out)."""
        return self.usable_pages * self.allocator.page_size
    # <<< ch21

    def kv_layers(self) -> int:
        """The layers of K and V a token keeps in the cache: the model's (from chapter 09 a drafter adds its own)."""
        return self.model.config.num_hidden_layers

    def token_bytes(self) -> int:
        """The bytes one token's K and V take in the pool, every layer's."""
        c, weight = self.model.config, self.model.model.embed_tokens.weight
        return self.kv_layers() * 2 * c.num_key_value_heads * c.head_dim * weight.dtype.itemsize

    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        """Lay out the step's batch: each request's new KV slots allocated and written to req_to_token."""
        # >>> ch05 removes ch04: the sampler writes each token into token_pool, on the device
        #| for req in reqs if mode is ForwardMode.DECODE else []:
        #|     self.write_next_token(req, req.output_ids[-1])     # the token the host received: the step's input
        # <<< ch05
        return build_batch(mode, reqs, self.allocator, self.tables, self.device)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's forward pass alone, its inputs read first -> logits [B, vocab]: what the loops of
        chapters 02 and 03 (minioverlap/reference/) sample from, one step at a time."""
        # >>> ch03 replaces ch02: the inputs are read from token_pool
        #| return self.forward(batch, batch.input_ids, self.attention(batch))
        return self.forward(batch, self.read_inputs(batch), self.attention(batch))
        # <<< ch03

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
        """The model over the batch's tokens -> the logits [B, vocab] of each request's last token. From
        chapter 13 a step that fits the captured graphs is one replay of them instead."""
        # >>> ch13 replaces ch02: graph or eager, decided here, once per step
        #| logits = self.model.compute_logits(self.model(input_ids, batch.positions, ctx)[batch.last_index])
        graphs = self.graphs_for(batch)
        if graphs is not None:
            logits = graphs.replay(batch, input_ids, ctx.page_table)
        else:
            logits = self.model.compute_logits(self.model(input_ids, batch.positions, ctx)[batch.last_index])
        # <<< ch13
        # >>> ch08: the checker
        self.record_kv_accesses(batch)
        # <<< ch08
        return logits

    def attention(self, batch: ForwardBatch) -> PagedAttention:
        """The step's attention context, with its page table read once, before any layer runs."""
        return self.context(self.kv_pool, self.tables.page_table(batch), batch)

    def context(self, kv_pool: KVPool, page_table: torch.Tensor, batch: ForwardBatch) -> PagedAttention:
        """An attention context over a pool: the one place one is made (a step's, a drafter's, a graph's)."""
        # >>> ch15 replaces ch02: of the class chosen at load
        #| return PagedAttention(kv_pool, page_table, batch)
        return self.attention_class(kv_pool, page_table, batch)
        # <<< ch15
    # >>> ch03: the inputs are read from token_pool

    def read_inputs(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's input tokens [T], read from token_pool as the step runs, in its own stream order.
        NOTE: from chapter 06 the previous step's sampler writes them on the same forward stream, so the
        read comes after that write."""
        # >>> ch08: a prefill writes its own prompt first (on the forward stream)
        if batch.prompt_tokens is not None and self.guards.prompt_on_forward_stream:
            self.tables.write_prompts(batch)
        # <<< ch08
        return self.tables.read_tokens(batch)
    # <<< ch03
    # >>> ch04: one step, launched

    def launch(self, batch: ForwardBatch, step: int) -> StepOutput:
        """Queue one step's work and return it launched; its tokens reach the host later (`wait`).
        From chapter 06 the work goes to the forward stream, after the schedule stream's writes."""
        # >>> ch06 replaces ch04: on the forward stream, with the step's GPU timestamps (None on CPU)
        #| return self.run(batch, step)
        with self.streams.forward():
            start = self.streams.timestamp()
            out = self.run(batch, step)
            out.gpu_events = (start, self.streams.timestamp())
        return out
        # <<< ch06

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, step: int) -> StepOutput:
        """The step, top to bottom:

            inputs    the page table (the attention context) and the input tokens, read once
            forward   the model over the batch: eagerly, or from chapter 13 one graph replay
            sample    each request's next token, which stays in token_pool for the next step (05)
            to host   the tokens, a window of one per request, start on their way to the host (the
                      host waits for them in `wait`)

        From chapter 08 the event the fence waits for is recorded once the inputs are read."""
        ctx, input_ids = self.attention(batch), self.read_inputs(batch)
        # >>> ch08: the fence's event: the step has read what it reads of the tables the scheduler writes
        read_done = self.streams.record()
        # <<< ch08
        # >>> ch16 replaces ch04: the logits kept: the step's logprobs come from them, with its sample
        #| tokens = sample(self.forward(batch, input_ids, ctx), batch.reqs)
        logits = self.forward(batch, input_ids, ctx)
        tokens = sample(penalized(logits, batch, self.tables), batch.reqs)
        self.logprobs = step_logprobs(logits[:, None], tokens[:, None], batch.reqs)   # a window of one
        # <<< ch16
        # >>> ch05: the token stays on the device, where the next step reads it
        self.tables.write_next_tokens(batch, tokens)
        # <<< ch05
        window = tokens[:, None], torch.ones(len(tokens), dtype=torch.int64)     # a window of one token, accepted
        # >>> ch08 removes ch04: with the fence's event (below)
        #| return self.output(step, batch, input_ids, *window)
        # <<< ch08
        # >>> ch16 replaces ch08: with the step's logprobs
        #| return self.output(step, batch, input_ids, *window, read_done)
        out = self.output(step, batch, input_ids, *window, read_done)
        out.logprobs = self.logprobs
        return out
        # <<< ch16

    def output(self, step: int, batch: ForwardBatch, input_ids: torch.Tensor, tokens: torch.Tensor,
               accept_lens: torch.Tensor,
               # >>> ch08: the fence's event
               read_done: Event | None,
               # <<< ch08
               ) -> StepOutput:
        """The launched step: each request's window of tokens [B, W] and accept length [B] started on their
        way to the host (a plain step's accept lengths are ones made on the host: nothing to copy). The
        tokens' copy comes last, so that its event covers both."""
        accept_lens_cpu, _ = to_host(accept_lens)
        cpu, copy_done = to_host(tokens)
        # >>> ch08 replaces ch04: the checker sees the copy-done event too; the fence's event
        #| return StepOutput(step, batch, input_ids, tokens, cpu, accept_lens, accept_lens_cpu, copy_done)
        copy_done = self.streams.record(copy_done)
        return StepOutput(step, batch, input_ids, tokens, cpu, accept_lens, accept_lens_cpu, copy_done, read_done)
        # <<< ch08

    # >>> ch19: a step whose sample was put off

    def waits_for_host(self, running: list[Req]) -> bool:
        """Whether the overlap loop must handle the step in flight before it builds the next: never for a
        plain step (a constrained one puts its sample off instead, and only that waits), nor with MTP (a
        constrained verify puts off its accept); always with a drafter on the host (NgramRunner)."""
        return False

    def launch_forward(self, batch: ForwardBatch, step: int) -> StepOutput:
        """Launch a step's forward alone, as run begins it: its sample needs masks from the tokens of the
        step still in flight, so it is queued later, by sample_later (SGLang's delay_sample_func)."""
        with self.streams.forward():
            start = self.streams.timestamp()
            input_ids, read_done, later = self.forward_alone(batch)
        return StepOutput(step, batch, input_ids, *[None] * 5, read_done, gpu_events=(start, None), sample_later=later)

    def forward_alone(self, batch: ForwardBatch) -> tuple[torch.Tensor, Event | None, Callable[[StepOutput], StepOutput]]:
        """The forward as run begins it -> the step's inputs, the fence's event (recorded once they are
        read) and what queues the rest: sample_step over the step's logits (SpecRunner: its accept)."""
        ctx, input_ids = self.attention(batch), self.read_inputs(batch)
        read_done = self.streams.record()
        return input_ids, read_done, partial(self.sample_step, self.forward(batch, input_ids, ctx))

    def sample_later(self, out: StepOutput) -> None:
        """Queue the rest of a step launched by launch_forward, now that the host can fill its masks: its sample
        and what follows it (StepOutput.sample_later), on the forward stream after its forward. `out` gets
        the step's tokens, their copy to the host and the end of its GPU time."""
        with self.streams.forward():
            done = out.sample_later(out)
            done.gpu_events = (out.gpu_events[0], self.streams.timestamp())
        out.__dict__.update(done.__dict__)

    def sample_step(self, logits: torch.Tensor, out: StepOutput) -> StepOutput:
        """What run does after the forward, for a step that put it off: sample (the masks filled now), the
        logprobs, the tokens into token_pool, their copy to the host."""
        tokens = sample(penalized(logits, out.batch, self.tables), out.batch.reqs)
        self.logprobs = step_logprobs(logits[:, None], tokens[:, None], out.batch.reqs)
        self.tables.write_next_tokens(out.batch, tokens)
        done = self.output(out.step, out.batch, out.input_ids, tokens[:, None], torch.ones(len(tokens), dtype=torch.int64),
                           out.read_done)
        done.logprobs = self.logprobs
        return done
    # <<< ch19

    def wait(self, out: StepOutput) -> None:
        """Block the host until the step's tokens are on it: the one place the host waits for the device."""
        # >>> ch08 replaces ch04: the checker records the host's wait
        #| if out.copy_done is not None:
        #|     out.copy_done.synchronize()
        self.streams.host_wait(out.copy_done, f"the host waits for step {out.step}'s tokens")
        # <<< ch08
    # >>> ch16: a handled step's logprobs

    def logprob_lists(self, out: StepOutput) -> list[list[TokenLogprob] | None]:
        """Each request's logprobs of the tokens out.token_lists() gives it (None: it did not ask), on the
        host once `wait` has returned. The step's own: in the overlap loop the runner's self.logprobs
        already belong to the next step, launched before this one is handled."""
        logprobs = out.logprobs
        if logprobs is None:
            return [None] * len(out.batch.reqs)
        return logprobs.lists(out.accept_lens_cpu.tolist(), out.batch.reqs)
    # <<< ch16
    # >>> ch09: what the host learns when it handles a step

    def commit(self, req: Req, tokens: list[int], out: StepOutput) -> None:
        """A handled step's tokens for req, as the runner counts them: nothing moves for a plain step, whose
        KV count moved when it was laid out (a speculative step's moves now: SpecRunner)."""
    # <<< ch09
    # <<< ch04
    # >>> ch06: the schedule stream, for one iteration of the loop

    def schedule_stream(self):
        """The schedule stream made current: the scheduler's loop runs each iteration inside it."""
        return self.streams.schedule()
    # <<< ch06
    # >>> ch20: DP attention's empty batch

    @torch.inference_mode()
    def run_empty_batch(self) -> None:
        """The step of a DP-attention rank with nothing to run (parallel/dp_scheduler.py): the model over no
        tokens, on the forward stream. It attends to nothing but joins every layer's MLP collectives
        (DPAttentionQwen3ForCausalLM.forward); there is nothing to wait for or handle after it."""
        nothing = torch.empty(0, dtype=torch.long, device=self.device)
        with self.streams.forward():
            self.model(nothing, nothing, None)
    # <<< ch20
    # >>> ch13: CUDA graphs

    def init_graphs(self, max_running: int) -> None:
        """Capture, once per batch-size bucket, the decode step's forward (a CUDA device only)."""
        self.graphs = DecodeGraphs(self.model, partial(self.context, self.kv_pool), self.tables.req_to_token, max_running)

    def graphs_for(self, batch: ForwardBatch) -> DecodeGraphs | None:
        """The captured graphs if the step fits them, else None: the one place a step is graph or eager."""
        return self.graphs if self.graphs is not None and self.graphs.fits(batch) else None
    # <<< ch13
    # >>> ch08: the fence; the checker's step names; what a step does to the KV pool, for the checker

    def fence(self, out: StepOutput) -> None:
        """What the scheduler queues from now on runs after the step's reads of the shared tables."""
        self.streams.fence(out.read_done)

    def name_step(self, step: int) -> None:
        """The checker's reports name the accesses from now on as step `step`'s."""
        if self.hazards:
            self.hazards.step = step

    def record_kv_accesses(self, batch: ForwardBatch, pool: str = "kv_pool", who: str = "attention") -> None:
        """Attention writes each new token's K and V, and reads every K and V of its request."""
        if not self.hazards:
            return
        for req, p, end in zip(batch.reqs, batch.prefix_lens, batch.ends()):
            slots = self.allocator.kv_slots(req.pages, 0, end)
            self.hazards.access(pool, slots[p:], "write", f"{who} stores request {req.uid}'s new K and V")
            self.hazards.access(pool, slots, "read", f"{who} reads request {req.uid}'s K and V")
    # <<< ch08
