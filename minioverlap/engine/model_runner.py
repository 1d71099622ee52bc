# >>> ch02 file: one forward step over the paged cache
"""The model runner: the model and the paged cache it reads and writes, one step at a time.

From chapter 04 one step is the runner's whole job: `launch` runs the forward pass, samples, leaves each
token on the device for the next step (05), starts copying the tokens to the host and returns the
launched step; `wait` blocks until its tokens are on the host. The scheduler decides what runs and
handles the results; it reaches the device only through the runner's methods.
"""

from __future__ import annotations

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.kv_pool import KVPool
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch08: the guards and the checker
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardChecker
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
# >>> ch03: per-request sampling
from minioverlap.engine.sampler import make_generator, sample
# <<< ch03
from minioverlap.model.qwen3 import Qwen3ForCausalLM
# >>> ch09: the MTP drafter
from minioverlap.engine.forward_batch import build_verify_batch, window_slack
from minioverlap.engine.speculative import speculate
from minioverlap.model.mtp import MTPLayer
# <<< ch09
# >>> ch10: the relay
from minioverlap.engine.forward_batch import resolve_window
from minioverlap.engine.relay import Relay
# <<< ch10
# >>> ch13: CUDA graphs
from minioverlap.engine.cuda_graph import DecodeGraphs, SpecGraphs
# <<< ch13


class ModelRunner:
    """The model and the device state a step touches, one step at a time."""
    # >>> ch09: no drafter unless init_drafter gives one
    mtp: MTPLayer | None = None
    mtp_steps: int = 0
    # <<< ch09
    # >>> ch13: no graphs unless init_graphs captures them
    graphs: DecodeGraphs | SpecGraphs | None = None
    # <<< ch13

    def __init__(self, model: Qwen3ForCausalLM, *, num_pages: int, page_size: int, max_running: int, max_seq_len: int,
                 # >>> ch08: the guards, and the checker, given to everything that records accesses
                 guards: Guards = Guards(), hazards: HazardChecker | None = None,
                 # <<< ch08
                 ) -> None:
        """The runner owns the model and everything a step touches on the device: the KV pool, the page
        allocator and the request tables (chapter 02), and the two streams (06). From chapter 08 it also
        holds the guards and the hazard checker, which it gives to everything that records accesses.
        Nothing above the runner touches a device table."""
        c, weight = model.config, model.model.embed_tokens.weight
        self.model, self.device = model, weight.device
        self.allocator = PageAllocator(num_pages, page_size)
        self.kv_pool = KVPool(c.num_hidden_layers, num_pages * page_size, c.num_key_value_heads, c.head_dim,
                              weight.dtype, weight.device)
        # >>> ch08 replaces ch02: the guards; the checker sees every access to the tables
        #| self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device)
        self.guards, self.hazards = guards, hazards
        self.tables = ReqToTokenPool(max_running, max_seq_len, weight.device, hazards)
        # <<< ch08
        # >>> ch06: the two streams
        # >>> ch08 replaces ch06: the checker sees the streams
        #| self.streams = Streams(self.device)
        self.streams = Streams(self.device, hazards)
        # <<< ch08
        # <<< ch06

    # >>> ch09: the MTP drafter
    def init_drafter(self, mtp: MTPLayer, mtp_steps: int) -> None:
        """Draft mtp_steps tokens a step with the MTP layer. It gets its own KV pool, one layer at the same
        KV slots as the target's: it shares req_to_token and the allocator (as SGLang's draft worker
        shares the target's pools). A request's windows reach past its last token (window_slack), so the
        request tables, still empty, are made that much wider."""
        k_pool = self.kv_pool.k[0]
        self.mtp, self.mtp_steps = mtp, mtp_steps
        self.draft_kv_pool = KVPool(1, k_pool.shape[0], k_pool.shape[1], k_pool.shape[2], k_pool.dtype, self.device)
        rows, width = self.tables.req_to_token.shape
        self.tables = ReqToTokenPool(rows - 1, width + window_slack(mtp_steps), self.device, self.hazards)
        # >>> ch10: the relay, one row per request slot
        self.relay = Relay(rows, mtp.eh_proj.out_features, k_pool.dtype, self.device, self.hazards)
        # <<< ch10

    # <<< ch09
    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        """Lay out the step's batch: each request's new KV slots allocated and written to req_to_token."""
        # >>> ch05 removes ch04: the sampler writes each token into token_pool, on the device
        #| for req in reqs if mode is ForwardMode.DECODE else []:
        #|     self.write_next_token(req, req.output_ids[-1])     # the token the host received: the step's input
        # <<< ch05
        # >>> ch09: with MTP a decode step verifies a window of k+1 positions per request
        if self.mtp is not None and mode is ForwardMode.DECODE:
            return build_verify_batch(reqs, self.mtp_steps + 1, self.allocator, self.tables, self.device)
        # <<< ch09
        return build_batch(mode, reqs, self.allocator, self.tables, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch; returns the logits [B, vocab] of each request's last token."""
        # >>> ch13: a decode step is one graph replay
        if self.graphed(batch):
            return self.replay(batch)
        # <<< ch13
        hidden = self.hidden_states(batch, self.attention(batch))
        return self.model.compute_logits(hidden[batch.last_index])

    def attention(self, batch: ForwardBatch) -> PagedAttention:
        """The step's attention context, with its page table read once, before any layer runs."""
        return PagedAttention(self.kv_pool, self.tables.page_table(batch), batch)

    def hidden_states(self, batch: ForwardBatch, ctx: PagedAttention) -> torch.Tensor:
        """The model over the batch's tokens -> final hidden states [T, hidden]."""
        # >>> ch03: the inputs are read from token_pool
        self.read_inputs(batch)
        # <<< ch03
        hidden = self.model(batch.input_ids, batch.positions, ctx)
        # >>> ch08: the checker
        self.record_kv_accesses(batch)
        # <<< ch08
        return hidden
    # >>> ch03: the inputs are read from token_pool

    def read_inputs(self, batch: ForwardBatch) -> None:
        """The step's input tokens, read from token_pool as the step runs, in its own stream order.
        NOTE: from chapter 06 the previous step's sampler writes them on the same forward stream, so the
        read comes after that write."""
        # >>> ch08: a prefill writes its own prompt first (on the forward stream)
        if batch.prompt_tokens is not None and self.guards.prompt_on_forward_stream:
            self.tables.write_prompts(batch)
        # <<< ch08
        batch.input_ids = self.tables.read_tokens(batch)
        # >>> ch08: the step has read what it reads of the tables the scheduler writes: the fence opens here
        self.reads_done(batch)
        # <<< ch08
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

    def run(self, batch: ForwardBatch, step: int) -> StepOutput:
        """Forward, sample, and start copying the tokens to the host."""
        # >>> ch09: with MTP, a speculative step
        if self.mtp is not None:
            return self.run_speculative(batch, step)
        # <<< ch09
        tokens = self.next_tokens(batch)
        cpu, copy_done = to_host(tokens)
        # >>> ch08: the checker sees the copy-done event too
        copy_done = self.streams.record(copy_done)
        # <<< ch08
        return StepOutput(step, batch, tokens, cpu, copy_done)
    # >>> ch09: with MTP, a speculative step

    @torch.inference_mode()
    def run_speculative(self, batch: ForwardBatch, step: int) -> StepOutput:
        """Each request's window of tokens and how many of them count, both started on their way to the host."""
        tokens, accept_lens = speculate(self, batch)
        cpu, _ = to_host(tokens)
        accept_lens_cpu, copy_done = to_host(accept_lens)      # behind the tokens' copy: its event covers both
        copy_done = self.streams.record(copy_done)
        return StepOutput(step, batch, tokens, cpu, copy_done, accept_lens=accept_lens, accept_lens_cpu=accept_lens_cpu)
    # <<< ch09

    def next_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """Each request's next token [B], on the device."""
        tokens = sample(self.forward(batch), batch.reqs)
        # >>> ch05: the token stays on the device, where the next step reads it
        self.tables.write_next_tokens(batch, tokens)
        # <<< ch05
        return tokens

    def wait(self, out: StepOutput) -> None:
        """Block the host until the step's tokens are on it: the one place the host waits for the device."""
        # >>> ch08 replaces ch04: the checker records the host's wait
        #| if out.copy_done is not None:
        #|     out.copy_done.synchronize()
        self.streams.host_wait(out.copy_done, f"the host waits for step {out.step}'s tokens")
        # <<< ch08
    # <<< ch04
    # >>> ch09: where the drafter's next inputs wait between steps

    def stash_drafts(self, batch: ForwardBatch, first: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep each request's next first draft and hidden state, on the device, for its next step."""
        # >>> ch10 replaces ch09: in the relay's rows of the step's slots
        #| for i, req in enumerate(batch.reqs):
        #|     req.draft = (first[i], hidden[i])
        self.relay.stash(batch.req_pool_indices, batch.rows, first, hidden)
        # <<< ch10
    # <<< ch09
    # >>> ch10: the relay

    def resolve(self, batch: ForwardBatch) -> None:
        """Read the relay's rows of the step's slots: lay the window out from the committed lengths, and
        hand the drafter its inputs."""
        seq_lens, draft, hidden = self.relay.read(batch.req_pool_indices, batch.rows)
        resolve_window(batch, seq_lens, self.tables)
        batch.draft_inputs = (draft, hidden)
    # <<< ch10
    # >>> ch13: CUDA graphs

    def init_graphs(self, max_running: int) -> None:
        """Capture, once per batch-size bucket, the decode step's forward, or with MTP the verify step's
        three passes (a CUDA device only)."""
        self.graphs = SpecGraphs(self, max_running) if self.mtp is not None else DecodeGraphs(self, max_running)

    def graphed(self, batch: ForwardBatch) -> bool:
        """The step runs as replays: graphs were captured for its kind of step."""
        return self.graphs is not None and self.graphs.fits(batch)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode step as one graph replay: its shared reads as in an eager step (recorded, and the
        fence's event after them), into the graphs' static buffers, then the replay -> logits [B, vocab]."""
        ctx = self.attention(batch)
        self.read_inputs(batch)
        logits = self.graphs.replay(batch, ctx.page_table)
        self.record_kv_accesses(batch)
        return logits

    def replay_target(self, batch: ForwardBatch) -> torch.Tensor:
        """A verify's target pass as one replay: its input tokens read as in an eager step (recorded), then
        the replay over the buffers the draft loaded -> hidden states [B*W, hidden]."""
        self.read_inputs(batch)
        hidden = self.graphs.target(batch)
        self.record_kv_accesses(batch)
        return hidden
    # <<< ch13
    # >>> ch08: the fence; the checker's step names; what a step does to the KV pool, for the checker

    def reads_done(self, batch: ForwardBatch) -> None:
        """The step has read what it reads of the tables the scheduler writes: record the event the fence waits for."""
        # >>> ch12 fix read-done-after-draft-extend: with MTP the draft extend reads the page table later, and records it
        if self.mtp is not None:
            return
        # <<< ch12
        batch.read_done = self.streams.record()

    def fence(self, out: StepOutput) -> None:
        """What the scheduler queues from now on runs after the step's reads of the shared tables."""
        self.streams.fence(out.batch.read_done)

    def name_step(self, step: int) -> None:
        """The checker's reports name the accesses from now on as step `step`'s."""
        if self.hazards:
            self.hazards.step = step

    def record_kv_accesses(self, batch: ForwardBatch) -> None:
        """Attention writes each new token's K and V, and reads every K and V of its request."""
        if not self.hazards:
            return
        for req, p, end in zip(batch.reqs, batch.prefix_lens, batch.ends()):
            slots = self.allocator.kv_slots(req.pages, 0, end)
            self.hazards.access("kv_pool", slots[p:], "write", f"attention stores request {req.uid}'s new K and V")
            self.hazards.access("kv_pool", slots, "read", f"attention reads request {req.uid}'s K and V")
            # >>> ch09: the drafter's K and V, at the same slots
            if self.mtp is not None:
                self.hazards.access("draft_kv_pool", slots[p:], "write", f"the drafter stores request {req.uid}'s K and V")
                self.hazards.access("draft_kv_pool", slots, "read", f"the drafter reads request {req.uid}'s K and V")
            # <<< ch09
    # <<< ch08

    # ---- request slots and pages
    def admit(self, req: Req) -> None:
        """Give the request a request slot; from chapter 03 its own generator if seeded, and its prompt
        in token_pool."""
        req.row = self.tables.alloc()
        # >>> ch03: per-request sampling; the prompt goes into token_pool
        req.generator = make_generator(req, self.device)
        self.write_prompt(req)
        # <<< ch03
    # >>> ch03: the prompt goes into token_pool

    def write_prompt(self, req: Req) -> None:
        """The scheduler writes the prompt into token_pool, on the schedule stream (chapter 03)."""
        # >>> ch08 fix prompt-on-forward-stream replaces ch03: only if asked: by default the prefill writes it, on the forward stream
        #| self.tables.write_tokens(req.row, 0, req.prompt_ids)
        if not self.guards.prompt_on_forward_stream:
            self.tables.write_tokens(req.row, 0, req.prompt_ids)
        # <<< ch08
    # <<< ch03

    def release(self, req: Req) -> None:
        """Give back the request's pages and its request slot."""
        self.allocator.free(req.pages)
        self.tables.free(req.row)
        req.pages, req.row = [], 0
    # >>> ch03: the host writes a token it has read back (before chapter 05 keeps it on the device)

    def write_next_token(self, req: Req, token: int) -> None:
        """The token, sampled and read back by the host, into token_pool: the next step's input."""
        self.tables.write_tokens(req.row, req.seq_len, [token])
    # <<< ch03
    # >>> ch04: what admission asks, and what the integrity check compares

    @property
    def free_rows(self) -> int:
        return self.tables.num_free

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def usable_pages(self) -> int:
        return self.allocator.num_pages - 1           # page 0 is never handed out

    def pages_for(self, num_tokens: int) -> int:
        return self.allocator.pages_for(num_tokens)

    def integrity_problems(self, owners: list[Req]) -> list[str]:
        """Every page and request slot is free or owned by exactly one of `owners`, and each owner's
        req_to_token row points at its own pages."""
        problems = []
        for what, owned, free, total in (
                ("page", [p for r in owners for p in r.pages], self.allocator.free_pages, self.allocator.num_pages),
                ("request slot", [r.row for r in owners], self.tables.free_rows, len(self.tables.is_free))):
            counts = {i: 0 for i in range(1, total)}
            for i in [*owned, *free]:
                counts[i] = counts.get(i, 0) + 1
            problems += [f"{what} {i} is {'lost' if n == 0 else f'owned or free {n} times'}"
                         for i, n in counts.items() if n != 1]
        for r in owners:
            if self.tables.slots_of(r.row, r.seq_len) != self.allocator.kv_slots(r.pages, 0, r.seq_len):
                problems.append(f"request {r.uid}: req_to_token row {r.row} does not point at its pages")
        return problems
    # <<< ch04
