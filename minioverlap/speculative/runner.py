# >>> ch09 file: one speculative step with the MTP drafter
"""SpecRunner: the model runner that speculates with the MTP drafter. It offers the plain runner's
interface (the scheduler and the face cannot tell them apart) and owns what speculation adds: the MTP
layer and its KV pool, from chapter 10 the relay, from chapter 13 the verify step's graphs.

One MTP step: draft, verify, accept, draft extend. All of it is queued on the device; the host learns
the outcome (each request's window of tokens and how many count) when it handles the step.

A request with committed length L (the target's and the MTP layer's KV hold positions 0..L-1) has its
bonus token b at position L (in token_pool, sampled by the previous step) and the MTP layer's first
draft d1 with the hidden state that produced it (from the previous step's draft extend). A decode step:

    draft         k-1 MTP passes, one row each, chain d1 -> d2 -> ... -> dk; the row at position L+i-1
                  reads d(i) and the previous row's MTP hidden state
    verify        the target runs the window b, d1..dk at positions L..L+k (its KV written for all k+1)
    accept        the accept rule (accept.py): tokens [k+1], accept_len = a+1
    draft extend  the MTP layer runs the same window with the target's hidden states and the accepted
                  tokens, rewriting its KV there; the row of the last accepted position gives the next
                  step's d1 and hidden state

KV written at rejected positions lies past the new length L+a+1; the next window starts there and
overwrites it. A prefill step runs the target over the prompt, samples the bonus token and runs the
draft extend over the prompt (each row reads the next prompt token; the last row reads the bonus).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minioverlap.cache.kv_pool import KVPool
from minioverlap.device.streams import Event
from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample
from minioverlap.engine.step import StepOutput
from minioverlap.model.mtp import MTPLayer
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.speculative.accept import accept
from minioverlap.speculative.verify_batch import build_verify_batch
from minioverlap.speculative.verify_runner import VerifyRunner
# >>> ch10: the relay
from minioverlap.speculative.relay import Relay
from minioverlap.speculative.verify_batch import resolve_window
# <<< ch10
# >>> ch13: CUDA graphs
from functools import partial

from minioverlap.speculative.graphs import SpecGraphs
# <<< ch13
# >>> ch16: logprobs, computed with the sample
from minioverlap.engine.logprobs import step_logprobs
from minioverlap.engine.sampler import penalized
# <<< ch16
# >>> ch18: a chunk's next prompt token
from minioverlap.device.transfer import to_device
# <<< ch18
# >>> ch19: a constrained window
from collections.abc import Callable

from minioverlap.device.transfer import to_host
from minioverlap.speculative.accept import mask_window
# <<< ch19


class SpecRunner(VerifyRunner):
    """The model runner with an MTP drafter: every decode step is a verify step."""
    # >>> ch13: no graphs unless init_graphs captures them
    graphs: SpecGraphs | None = None
    # <<< ch13

    def __init__(self, model: Qwen3ForCausalLM, mtp: MTPLayer, mtp_steps: int, *, max_seq_len: int, **sizes) -> None:
        """Draft mtp_steps tokens a step with the MTP layer. It gets its own KV pool, one layer at the same
        KV slots as the target's: it shares req_to_token and the allocator (as SGLang's draft worker
        shares the target's pools). What it counts as any verifying runner does is VerifyRunner's: its
        request tables are wider by as far as a request's windows reach past its last token."""
        self.mtp = mtp
        super().__init__(model, mtp_steps, max_seq_len=max_seq_len, **sizes)
        k = self.kv_pool.k[0]
        self.draft_kv_pool = KVPool(1, k.shape[0], k.shape[1], k.shape[2], k.dtype, self.device)
        # >>> ch10: the relay, one row per request slot
        self.relay = Relay(self.tables.req_to_token.shape[0], mtp.eh_proj.out_features, k.dtype, self.device,
                           self.hazards)
        # <<< ch10

    def kv_layers(self) -> int:
        """The target's layers and the drafter's one."""
        return super().kv_layers() + 1

    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        """A prefill as the plain runner lays it out; a decode step verifies a window of k+1 positions per request."""
        if mode is ForwardMode.DECODE:
            return build_verify_batch(reqs, self.draft_steps + 1, self.allocator, self.tables, self.device)
        return super().batch(mode, reqs)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, step: int) -> StepOutput:
        """The step: a prefill or a verify, each request's window of tokens and how many of them count,
        started on their way to the host with the fence's event."""
        verify = batch.mode is ForwardMode.TARGET_VERIFY
        tokens, accept_lens, input_ids, read_done = self.verify(batch) if verify else self.prefill(batch)
        # >>> ch16 replaces ch09: with the step's logprobs
        #| return self.output(step, batch, input_ids, tokens, accept_lens, read_done)
        out = self.output(step, batch, input_ids, tokens, accept_lens, read_done)
        out.logprobs = self.logprobs
        return out
        # <<< ch16

    def prefill(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Event | None]:
        """The target over the prompts, the bonus token sampled, the draft extend over the prompts ->
        each request's window of one (the bonus), its accept length, the step's inputs, the fence's event."""
        ctx, input_ids = self.attention(batch), self.read_inputs(batch)
        spec = SpecStep(batch, ctx, self, input_ids=input_ids)
        # >>> ch12 fix read-done-after-draft-extend removes ch09: the draft extend reads the page table later, and records the event
        #| spec.read_done = self.streams.record()            # as a plain step records it: once the inputs are read
        # <<< ch12
        spec.hidden = self.target(batch, input_ids, ctx)
        self.record_kv_accesses(batch)
        # >>> ch16 replaces ch09: the logits kept, for the logprobs
        #| bonus = sample(self.model.compute_logits(spec.hidden[batch.last_index]), batch.reqs)
        logits = self.model.compute_logits(spec.hidden[batch.last_index])
        bonus = sample(penalized(logits, batch, self.tables), batch.reqs)
        # the bonus token's logprobs: from these logits, in this step, on their way to the host before the
        # tokens' copy (run hands them to the step)
        self.logprobs = step_logprobs(logits[:, None], bonus[:, None], batch.reqs)
        # <<< ch16
        self.tables.write_next_tokens(batch, bonus)
        # >>> ch10: where each request's first window starts
        self.relay.publish(batch.req_pool_indices, batch.rows, batch.seq_lens)
        # <<< ch10
        next_ids = input_ids.roll(-1)                        # row p reads token p+1 ...
        next_ids[batch.last_index] = bonus                   # ... and the last row the bonus token
        # >>> ch18: ... unless its rows are a chunk: then its prompt's next token, which the host knows
        if any(batch.chunks()):
            after = to_device([r.prompt_token(e) for r, e in zip(batch.reqs, batch.ends())], torch.int64, self.device)
            next_ids[batch.last_index] = torch.where(after >= 0, after, bonus)
        # <<< ch18
        read_done = self.draft_extend(spec, next_ids, batch.last_index)
        return bonus[:, None], torch.ones_like(bonus), input_ids, read_done

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Event | None]:
        """Draft k tokens and verify them with one target pass (verify_passes), then accept and draft-extend
        over the window (accept_window)."""
        return self.accept_window(self.verify_passes(batch))

    def verify_passes(self, batch: ForwardBatch) -> SpecStep:
        """The passes of a verify step that need nothing from the host: the window laid out, the k-1 draft
        passes, the window b, d1..dk written to token_pool and read back, the target over it."""
        batch, draft_inputs = self.resolve(batch)
        ctx, passes = self.attention(batch), self.passes(batch)
        spec = SpecStep(batch, ctx, passes, drafts=passes.draft(batch, ctx, draft_inputs))
        # >>> ch19: a constrained request's window masks walk its drafts on the host: they start on their way now
        spec.drafts_cpu = self.drafts_to_host(batch, spec.drafts)
        # <<< ch19
        self.tables.write_drafts(batch, spec.drafts)         # the window b, d1..dk in token_pool: the verify's input
        spec.input_ids = self.read_inputs(batch)
        # >>> ch12 fix read-done-after-draft-extend removes ch09: the draft extend reads the page table later, and records the event
        #| spec.read_done = self.streams.record()            # as a plain step records it: once the inputs are read
        # <<< ch12
        spec.hidden = passes.target(batch, spec.input_ids, ctx)
        self.record_kv_accesses(batch)
        return spec

    def accept_window(self, spec: SpecStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Event | None]:
        """The accept rule over the target's logits, the accepted tokens written, the draft extend over the
        window -> each request's window of tokens [B, W], its accept length [B], the step's inputs, the
        fence's event."""
        batch, B, W = spec.batch, len(spec.batch.reqs), spec.batch.extend_lens[0]
        logits = self.model.compute_logits(spec.hidden).view(B, W, -1)
        tokens, accept_lens = accept(self.judged(logits, spec), spec.drafts, batch.reqs)
        # >>> ch16: each window token's logprobs, from its own row
        self.logprobs = step_logprobs(logits, tokens, batch.reqs)
        # <<< ch16
        self.tables.write_window(batch, tokens)              # the accepted tokens, and the next bonus at L + accept_len
        # >>> ch10: where each request's next window starts
        self.relay.publish(batch.req_pool_indices, batch.rows, batch.seq_lens - W + accept_lens)
        # <<< ch10
        last = torch.arange(B, device=tokens.device) * W + accept_lens - 1     # each request's last accepted row
        return tokens, accept_lens, spec.input_ids, self.draft_extend(spec, tokens.flatten(), last)

    def judged(self, logits: torch.Tensor, spec: SpecStep) -> torch.Tensor:
        """The logits [B, W, vocab] the accept rule judges a verify's drafts by: the target's; from chapter 16
        each request's repetition_penalty and min_tokens applied, from chapter 19 a constrained request's
        rows masked by its grammar after the drafts before them. Copies: the logprobs stay the model's."""
        # >>> ch16: repetition_penalty and min_tokens, each row by the tokens before it (the drafts included)
        logits = penalized(logits, spec.batch, self.tables)
        # <<< ch16
        # >>> ch19: a constrained request's drafts judged by its masked rows
        logits = self.masked_window(logits, spec)
        # <<< ch19
        return logits

    def passes(self, batch: ForwardBatch) -> SpecRunner | SpecGraphs:
        """What runs a verify's three passes (draft, target, draft extend): the runner itself, eagerly; from
        chapter 13 the captured graphs where they fit the step, decided once (graphs_for)."""
        # >>> ch13 replaces ch09: graph replays where graphs were captured for the step
        #| return self
        return self.graphs_for(batch) or self
        # <<< ch13

    def target(self, batch: ForwardBatch, input_ids: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
        """The target over the batch's tokens -> hidden states [T, hidden]."""
        return self.model(input_ids, batch.positions, ctx)

    def draft(self, batch: ForwardBatch, ctx: PagedAttention,
              draft_inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """d1 from the last draft extend, then k-1 MTP passes, each the drafter's argmax -> drafts [B, k]."""
        token, hidden = draft_inputs
        drafts = [token]
        for i in range(1, self.draft_steps):
            row = draft_row(batch, i - 1)
            hidden = self.mtp(token, hidden, row.positions, self.context(self.draft_kv_pool, ctx.page_table, row))
            token = self.mtp.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def draft_extend(self, spec: SpecStep, next_ids: torch.Tensor, last: torch.Tensor) -> Event | None:
        """The MTP layer over the step's rows (tokens p+1, the target's hidden states at p): its KV for
        them, and from each request's `last` row the next first draft and its hidden state, kept for the
        next step. Like SGLang's draft extend, a pass of its own: it prepares its own attention context,
        reading the page table. Returns the event the fence waits for (from chapter 12 its own, recorded
        after that read: the step's last read of a table the scheduler writes)."""
        batch = spec.batch
        # >>> ch19: a step that put its accept off read the page table when launched, and recorded the event then
        if spec.launch_page_table is not None:
            self.stash_drafts(batch, *spec.passes.extend_rows(batch, next_ids, spec.hidden, last, spec.launch_page_table))
            return None
        # <<< ch19
        page_table = self.tables.page_table(batch, "the draft extend")
        # >>> ch12 fix read-done-after-draft-extend replaces ch09: the page-table read above is the step's last read of a shared table
        #| read_done = spec.read_done                        # the step's, recorded once its inputs were read
        read_done = self.streams.record()
        # <<< ch12
        self.stash_drafts(batch, *spec.passes.extend_rows(batch, next_ids, spec.hidden, last, page_table))
        return read_done

    def extend_rows(self, batch: ForwardBatch, next_ids: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor,
                    page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over the rows -> from each request's `last` row its next first draft [B] and hidden state."""
        out = self.mtp(next_ids, hidden, batch.positions, self.context(self.draft_kv_pool, page_table, batch))[last]
        return self.mtp.compute_logits(out).argmax(dim=-1), out

    def stash_drafts(self, batch: ForwardBatch, first: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep each request's next first draft and hidden state, on the device, for its next step."""
        # >>> ch10 replaces ch09: in the relay's rows of the step's slots
        #| for i, req in enumerate(batch.reqs):
        #|     req.draft = (first[i], hidden[i])
        self.relay.stash(batch.req_pool_indices, batch.rows, first, hidden)
        # <<< ch10

    def resolve(self, batch: ForwardBatch) -> tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor]]:
        """A verify's batch with its window laid out, and the drafter's inputs (in chapter 09 as the host
        laid them out; from chapter 10 from the relay's rows of the step's slots, on the device)."""
        # >>> ch10 replaces ch09: the host gave slot numbers only: the relay's rows of the step's slots give the rest, on the device
        #| return batch, batch.draft_inputs
        seq_lens, draft, hidden = self.relay.read(batch.req_pool_indices, batch.rows)
        return resolve_window(batch, seq_lens, self.tables), (draft, hidden)
        # <<< ch10


    # >>> ch19: a constrained window

    def drafts_to_host(self, batch: ForwardBatch, drafts: torch.Tensor) -> tuple[torch.Tensor, Event | None] | None:
        """If a request of the step follows a grammar, the drafts start on their way to the host, before the
        target pass is queued: the window masks walk them (Grammar.fill_window), so the host waits for the
        drafter's passes alone, while the target's may still run. None if no request does."""
        if not any(r.grammar is not None for r in batch.reqs):
            return None
        cpu, copied = to_host(drafts)
        return cpu, self.streams.record(copied)

    def masked_window(self, logits: torch.Tensor, spec: SpecStep) -> torch.Tensor:
        """The verify's logits [B, W, vocab], or, if a request of it follows a grammar, a copy with that
        request's rows masked (mask_window), once the drafts are on the host."""
        if spec.drafts_cpu is None:
            return logits
        cpu, copied = spec.drafts_cpu
        self.streams.host_wait(copied, "the host waits for a verify's drafts, to mask its window")
        return mask_window(logits, cpu.tolist(), spec.batch.reqs)

    def forward_alone(self, batch: ForwardBatch) -> tuple[torch.Tensor, Event | None, Callable[[StepOutput], StepOutput]]:
        """A verify up to its target pass (verify_passes): its accept needs masks filled from the tokens of
        the step still in flight, so it is queued later, with the draft extend after it (accept_later), as
        the plain runner puts off its sample. The step's reads of the shared tables are all queued now, so
        the fence's event is recorded here, and the draft extend will use the page table the verify read:
        reading it then, after the event, would race the scheduler's next writes. Only a verify puts its
        accept off: a prefill's requests have no token in flight (GrammarManager.puts_off)."""
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            raise RuntimeError(f"only a verify puts its accept off, not a {batch.mode.name} step")
        spec = self.verify_passes(batch)
        spec.launch_page_table = spec.ctx.page_table
        return spec.input_ids, self.streams.record(), partial(self.accept_later, spec)

    def accept_later(self, spec: SpecStep, out: StepOutput) -> StepOutput:
        """What run does after a verify's passes, for a step that put its accept off: the accept (the masks
        filled now), the accepted tokens written, the draft extend, the window's copy to the host."""
        tokens, accept_lens, input_ids, _ = self.accept_window(spec)
        done = self.output(out.step, out.batch, input_ids, tokens, accept_lens, out.read_done)
        done.logprobs = self.logprobs
        return done
    # <<< ch19

    def record_kv_accesses(self, batch: ForwardBatch) -> None:
        """The target's K and V, and the drafter's, at the same slots."""
        super().record_kv_accesses(batch)
        super().record_kv_accesses(batch, "draft_kv_pool", "the drafter")
    # >>> ch13: CUDA graphs

    def init_graphs(self, max_running: int) -> None:
        """Capture, once per batch-size bucket, the verify step's three passes (a CUDA device only)."""
        self.graphs = SpecGraphs(self.draft, self.target, self.extend_rows, context=partial(self.context, self.kv_pool),
                                 table=self.tables.req_to_token, hidden=self.relay.hidden, window=self.draft_steps + 1,
                                 max_running=max_running)
    # <<< ch13


def draft_row(batch: ForwardBatch, j: int) -> ForwardBatch:
    """Window row j of every request as a decode batch: position L+j, its KV slot, L+j+1 keys visible."""
    B, W = len(batch.reqs), batch.extend_lens[0]
    return replace(batch, mode=ForwardMode.DECODE, positions=batch.positions.view(B, W)[:, j],
                   out_cache_loc=batch.out_cache_loc.view(B, W)[:, j], seq_lens=batch.seq_lens - W + j + 1)


@dataclass(eq=False)
class SpecStep:
    """A speculative step as its passes leave it for what follows them: the accept (a verify's) and the
    draft extend. Its fields fill in as the passes are queued."""
    batch: ForwardBatch                  # a verify's with its windows laid out (SpecRunner.resolve)
    ctx: PagedAttention                  # the passes' attention context: the page table they read
    # >>> ch13 replaces ch09: or the graphs of the passes
    #| passes: SpecRunner                   # what runs the passes, the draft extend's too
    passes: SpecRunner | SpecGraphs      # what runs the passes, the draft extend's too
    # <<< ch13
    drafts: torch.Tensor | None = None   # [B, k] a verify's drafts, on the device
    input_ids: torch.Tensor | None = None   # [T] the tokens the step read: a verify's windows b, d1..dk
    hidden: torch.Tensor | None = None   # [T, hidden] the target's
    # >>> ch12 fix read-done-after-draft-extend removes ch09: the draft extend records the event itself
    #| read_done: Event | None = None       # the fence's event, recorded once the inputs are read
    # <<< ch12
    # >>> ch19: a constrained window; a verify whose accept was put off
    drafts_cpu: tuple[torch.Tensor, Event | None] | None = None   # the drafts on their way to the host (drafts_to_host)
    launch_page_table: torch.Tensor | None = None   # the page table it read when launched: its draft extend's
    # <<< ch19
