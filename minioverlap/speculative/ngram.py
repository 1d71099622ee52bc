# >>> ch19 file: the n-gram drafter on the host (prompt lookup decoding)
"""Speculative decoding with no drafter model: the drafts are looked up in the request's own tokens.

Prompt lookup decoding (vLLM's ngram proposer, SGLang's NGRAM method): the last n tokens of a request
(its prompt and what it has generated) are searched for earlier in the same sequence; if they occurred
before, the tokens that followed them then are the guess for what follows now. Text that repeats itself
(code that reuses names, an answer that quotes its prompt, a list) is guessed well; other text gets
no proposal and the step verifies nothing but its bonus token.

The lookup runs on the host, over token ids the host holds. That is its price in an overlap engine: a
step's drafts need every token the step before accepted, so that step must be waited for and handled
before the next one is built (Scheduler.overlap_loop). The verify step itself is the MTP runner's
(speculative/runner.py) without its drafter: a window of k+1 positions per request, the bonus token
then the k drafts, and the same lossless accept rule (accept.py), greedy or sampled. A wrong draft costs
a wasted row of the window, never a wrong token.
"""

from __future__ import annotations

import time

import torch

from minioverlap.device.streams import Event
from minioverlap.device.transfer import to_device
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.logprobs import step_logprobs
from minioverlap.engine.sampler import penalized
from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.speculative.accept import accept, mask_window
from minioverlap.speculative.verify_batch import build_verify_batch, resolve_window
from minioverlap.speculative.verify_runner import VerifyRunner


def ngram_draft(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens,
    trying the longest n first (max_n down to min_n): a longer match is a more specific context, so
    its continuation is the better guess. Fewer than k where the sequence ends first; [] if no n matches."""
    # >>> exercise 19.2: the n-gram lookup
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):       # the latest start first, the suffix itself excluded
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
    # <<< exercise 19.2


def pad_drafts(proposal: list[int], k: int, filler: int) -> list[int]:
    """A proposal as exactly k drafts: a short one filled with `filler`. The filler is only a guess like
    any other: the accept rule rejects it unless the target agrees, so the tokens never depend on it."""
    return (proposal + [filler] * k)[:k]


class NgramRunner(VerifyRunner):
    """The model runner whose drafts come from an n-gram lookup on the host: every decode step is a verify
    step of window k+1, run by the target alone."""

    def __init__(self, model: Qwen3ForCausalLM, ngram_steps: int, *, max_seq_len: int, **sizes) -> None:
        """Draft ngram_steps tokens a step by lookup (the tables as wide as VerifyRunner makes them).
        `lookup_ns` collects the host time of each step's lookups, the work the device waits for between
        steps."""
        self.lookup_ns: list[int] = []
        super().__init__(model, ngram_steps, max_seq_len=max_seq_len, **sizes)

    def waits_for_host(self, running: list[Req]) -> bool:
        """Always: each step's drafts are looked up from the tokens the step before accepted, on the host, so
        the overlap loop handles each step before it builds the next."""
        return True

    def batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        """A prefill as the plain runner lays it out; a decode step verifies a window of k+1 positions per
        request, laid out from the host's counts: the step before has been handled, so each request's
        committed length is known here (the MTP runner must read it from the relay, on the device)."""
        if mode is not ForwardMode.DECODE:
            return super().batch(mode, reqs)
        batch = build_verify_batch(reqs, self.draft_steps + 1, self.allocator, self.tables, self.device)
        return resolve_window(batch, to_device([r.seq_len for r in reqs], torch.int64, self.device), self.tables)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, step: int) -> StepOutput:
        """A prefill as the plain runner runs it (one bonus token); a verify: the lookup on the host, the
        drafts to the device, one target pass over the windows, the accept rule."""
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            return super().run(batch, step)
        proposed = self.propose(batch.reqs)
        tokens, accept_lens, input_ids, read_done = self.verify(batch, proposed)
        out = self.output(step, batch, input_ids, tokens, accept_lens, read_done)
        out.logprobs = self.logprobs
        return out

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's k drafts, looked up in its prompt and the tokens it has received (all of them: its
        last is the bonus token at the window's start). Timed, into lookup_ns."""
        start, k = time.perf_counter_ns(), self.draft_steps
        drafts = []
        for req in reqs:
            tokens = req.prompt_ids + req.output_ids
            if len(tokens) != req.seq_len + 1:
                raise RuntimeError(f"request {req.uid}: the host holds {len(tokens)} tokens, its committed length is "
                                   f"{req.seq_len}: the step before was not handled before this one was built")
            drafts.append(pad_drafts(ngram_draft(tokens, k), k, tokens[-1]))
        self.lookup_ns.append(time.perf_counter_ns() - start)
        return drafts

    def verify(self, batch: ForwardBatch, proposed: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Event | None]:
        """The window b, d1..dk in token_pool, one target pass over it, the accept rule (over masked rows
        where a grammar constrains: the drafts are the host's own) -> each request's window of tokens
        [B, W], its accept length [B], the step's inputs and the fence's event."""
        B, W, ctx = len(batch.reqs), batch.extend_lens[0], self.attention(batch)
        drafts = to_device(proposed, torch.int64, self.device)
        self.tables.write_drafts(batch, drafts)              # after the bonus token the previous step wrote
        input_ids = self.read_inputs(batch)
        read_done = self.streams.record()                    # the step has read the shared tables
        hidden = self.model(input_ids, batch.positions, ctx)
        self.record_kv_accesses(batch)
        logits = self.model.compute_logits(hidden).view(B, W, -1)    # every row: row j judges draft j+1
        tokens, accept_lens = accept(mask_window(penalized(logits, batch, self.tables), proposed, batch.reqs), drafts, batch.reqs)
        self.logprobs = step_logprobs(logits, tokens, batch.reqs)
        self.tables.write_window(batch, tokens)              # the accepted tokens, and the next bonus at L + accept_len
        return tokens, accept_lens, input_ids, read_done

    def init_graphs(self, max_running: int) -> None:
        """None captured: the plain runner's graphs fit a decode step of one row per request, and every
        decode step here is a verify window, which runs eagerly."""
