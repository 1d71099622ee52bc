# >>> ch21 file: retraction
"""Retraction: when a step cannot get a page for each of its requests, requests are taken back.

Admission by need (PrefillAdder.fits) counts a running request for the pages it holds and a share of the
tokens it may still make, SGLang's `new_token_ratio`: 0.7 of them at first, decaying each decode step
towards 0.14 of that over 600 steps, since most requests stop long before max_tokens. More requests run
at once than the pool could hold whole; when the estimate was too low, a step finds too few pages, and
the scheduler takes requests back (SGLang's ScheduleBatch.retract_decode):

    order     fewest output tokens first, then the longest prompt: the least work lost first
    free      its pages and request slot go back through the frees (chapter 07's rules; from chapter 17
              what it computed stays in the tree), and it joins the front of the waiting queue
    refill    when it is admitted again it fills its prompt and the tokens it had received (fill_ids),
              and the token sampled after them is its next: a run that never retracted gives the same
    estimate  raised to what the requests kept have made so far, so that admission turns cautious
              instead of taking back again what it just admitted (a retraction storm)

It keeps taking back while the pages left would not last the requests kept RETRACT_DECODE_STEPS steps,
and always keeps one.

In the overlap loop step N is in flight when step N+1 is scheduled. N+1 is built without the request;
N stays as it was launched (SGLang #1860: a retraction that edits the batch in flight breaks the step's
results), and its token for the request is the request's, handled as any other (it joins fill_ids).
When N's requests that finish free enough pages for N+1 (they are not in N+1: can_decode), the loop
launches nothing this iteration instead and handles N first (SGLang v0.5.22's rule).
"""

from __future__ import annotations

import math

from minioverlap.engine.request import Req

CLIP_MAX_NEW_TOKENS = 4096       # a request's growth counted at most this many tokens (SGLang's clip)
RETRACT_DECODE_STEPS = 20        # the steps the pages left must last the requests kept
MIN_RATIO_FACTOR, DECAY_STEPS = 0.14, 600


class NewTokenRatio:
    """The share of a request's remaining tokens that admission counts (SGLang's new_token_ratio)."""

    def __init__(self, init: float) -> None:
        self.init, self.min = init, init * MIN_RATIO_FACTOR
        self.decay = (self.init - self.min) / DECAY_STEPS
        self.value = init

    def step(self) -> None:
        """A decode step ran: the requests stopped less often than feared; count a little less."""
        self.value = max(self.min, self.value - self.decay)

    def reset(self) -> None:
        """Nothing runs: start again from the first estimate."""
        self.value = self.init

    def raise_after(self, kept: list[Req]) -> None:
        """A retraction: the share of their max_tokens that the requests kept have made, with
        RETRACT_DECODE_STEPS more each, as SGLang sets it (at most 1; never lower than it was)."""
        made = sum(len(r.output_ids) for r in kept) + RETRACT_DECODE_STEPS * len(kept)
        self.value = max(self.value, min(1.0, made / max(1, sum(r.max_new_tokens for r in kept))))


def growth_pages(pages_for, req: Req, tokens_needed: int, ratio: float) -> int:
    """The pages req is counted for beyond those it holds: the rest of what it fills, and `ratio` of the
    tokens it may still make (tokens_needed: every position it may hold; at most CLIP_MAX_NEW_TOKENS)."""
    # >>> exercise 21.2: the growth estimate
    laid = max(req.seq_len, req.fill_len)
    growth = min(tokens_needed - laid, CLIP_MAX_NEW_TOKENS) * ratio
    return max(0, pages_for(laid + math.ceil(growth)) - len(req.pages))
    # <<< exercise 21.2


def retraction_order(reqs: list[Req]) -> list[Req]:
    """The order requests are taken back in: fewest output tokens first, then the longest prompt."""
    # >>> exercise 21.1: the retraction order
    return sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
    # <<< exercise 21.1


class Retraction:
    """A scheduler's admission by need and its retractions: the estimate, and what a step takes back.
    It uses the scheduler's runner, cache manager, queues, trace and frees."""

    def __init__(self, scheduler, new_token_ratio: float) -> None:
        self.scheduler = scheduler
        self.new_token_ratio = NewTokenRatio(new_token_ratio)
        self.count = 0                                     # requests taken back so far

    def estimate(self) -> float:
        """The share of a request's remaining tokens that admission counts now (from the start again
        when nothing runs)."""
        if not self.scheduler.running:
            self.new_token_ratio.reset()
        return self.new_token_ratio.value

    def make_room(self, reqs: list[Req], new: list[Req], decode: bool) -> list[Req]:
        """The step's requests, less those taken back so that the others get their pages (the requests
        just admitted, `new`, fit by admission and stay); a decode step decays the estimate. [] if the
        loop should handle the step in flight first: its finishing requests free enough."""
        short = self.pages_short(reqs)
        if short > 0 and self.scheduler.in_flight and short <= self.pages_finishing():
            return []
        if short > 0:
            reqs = self.take_back(reqs, new)
        if reqs and decode:
            self.new_token_ratio.step()
        return reqs

    def take_back(self, reqs: list[Req], new: list[Req]) -> list[Req]:
        """Take requests back in retraction order until the others get their pages and the pages left
        last them RETRACT_DECODE_STEPS more steps; always keep one. [] if the pages they need are still
        held by the step in flight (chapter 07's deferred release): the loop handles it first."""
        kept, taken = list(reqs), []
        for req in retraction_order([r for r in reqs if r not in new]):
            if len(kept) == 1 or (self.pages_short(kept) <= 0 and self.room_lasts(kept)):
                break
            kept.remove(req)
            self.retract(req)
            taken.append(req)
        scheduler = self.scheduler
        scheduler.waiting.extendleft(reversed(taken))      # at the front, in the order taken
        self.new_token_ratio.raise_after(kept)
        scheduler.trace.record("retract", scheduler.step + 1, [r.uid for r in taken])
        return [] if self.pages_short(kept) > 0 and scheduler.in_flight else kept

    def pages_short(self, reqs: list[Req]) -> int:
        """How many more pages the step's requests take than the pool can give now."""
        runner = self.scheduler.runner
        return sum(runner.step_pages(r) for r in reqs) - runner.cache.available_size

    def pages_finishing(self) -> int:
        """The pages of the running requests that take no further step: the step in flight is their last,
        and handling it frees them."""
        return sum(len(r.pages) for r in self.scheduler.running if not r.prefilling and not r.can_decode)

    def room_lasts(self, kept: list[Req]) -> bool:
        """Whether the pages left last the requests kept RETRACT_DECODE_STEPS more steps."""
        runner = self.scheduler.runner
        need = sum(max(0, runner.allocator.pages_for(r.seq_len + RETRACT_DECODE_STEPS) - len(r.pages)) for r in kept)
        return need <= runner.cache.available_size

    def retract(self, req: Req) -> None:
        """Take a running request back: its slot and pages go back as a finished request's do (chapter
        07's rules), and it will fill again what it has; the step in flight, if it holds the request,
        stays as it was launched."""
        self.scheduler.running.remove(req)
        self.scheduler.release(req)
        req.seq_len = req.kv_len = 0
        req.extend_input_len = None
        req.retractions += 1
        self.count += 1
