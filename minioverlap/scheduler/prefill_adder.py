# >>> ch04 file: the prefill adder
"""The prefill adder: what one step takes, SGLang's PrefillAdder (managers/schedule_policy.py).

The scheduler makes one for each step and asks it, in this order:

    add_chunks   (chapter 18) the next chunk of each prompt begun, within the step's budget of tokens
    add_waiting  the waiting requests that fit, in order, each given a request slot; from chapter 17 each
                 matched against the prefix cache first, from chapter 18 while the budget lasts
    step_kind    a prefill step if any prompt runs, else a decode step (from chapter 18: or both, mixed)

`fits` is the admission rule: a request slot is free, and the pages not yet promised to running
requests cover every page the request may need. The pages are the cache manager's to count
(`available_size`: the free ones, and from chapter 17 those the tree may evict).
"""

from __future__ import annotations

from collections import deque

from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
# >>> ch18: a step's budget of prompt tokens
from minioverlap.scheduler.budget import TokenBudget
# <<< ch18
# >>> ch21: admission by need
from minioverlap.scheduler.retraction import growth_pages
# <<< ch21


class PrefillAdder:
    """One step's choice of requests: the prompts it runs (`prefill`), or else the decode rows."""
    # >>> ch21: admission by need: the share of its remaining tokens a request is counted for (None: all)
    new_token_ratio: float | None = None
    # <<< ch21

    def __init__(self, runner: ModelRunner, running: list[Req],
                 # >>> ch18: the step's prompt tokens (None: every prompt whole), and mixed steps
                 chunked_prefill_size: int | None = None, mixed_chunk: bool = False,
                 # <<< ch18
                 ) -> None:
        """Over the runner, its cache manager and the running requests, which those it admits join."""
        self.runner, self.cache, self.running = runner, runner.cache, running
        self.prefill: list[Req] = []          # the requests whose prompt tokens the step runs, in order
        # >>> ch18: the step's budget: chunked_prefill_size, less a mixed step's decode rows
        self.mixed_chunk = mixed_chunk
        decode_rows = sum(r.can_decode for r in self.running) if self.mixed_chunk else 0
        self.budget = TokenBudget(chunked_prefill_size, decode_rows)
        # <<< ch18
    # >>> ch18: chunked prefill

    def add_chunks(self) -> list[Req]:
        """Running requests whose prompts are partly prefilled (chunked), each given its next chunk."""
        chunks = []
        for req in self.running:
            if req.prefilling and not self.budget.spent:
                self.budget.take(req)
                chunks.append(req)
        self.prefill += chunks
        return chunks
    # <<< ch18

    def add_waiting(self, waiting: deque[Req]) -> list[Req]:
        """Admit waiting requests, in order, while a slot is free and the pages cover them: each leaves
        `waiting` for `running` with a request slot (from chapter 17 after its cached prefix is matched;
        from chapter 18 while the budget lasts, each with its first chunk)."""
        new = []
        # >>> ch17 replaces ch04: its cached prefix first: pages it will not allocate
        #| while waiting and self.fits(waiting[0]):
        #|     req = waiting.popleft()
        while waiting:
            req = waiting[0]
            # >>> ch18: while the budget lasts
            if self.budget.spent:
                break
            # <<< ch18
            # >>> ch21: a retracted request fills the tokens it had received too
            req.recomputed = len(req.output_ids)
            # <<< ch21
            self.cache.match_req(req)
            if not self.fits(req):
                self.cache.release(req)          # its prefix unlocked again: it waits
                break
            waiting.popleft()
        # <<< ch17
            # >>> ch18: its first chunk
            self.budget.take(req)
            # <<< ch18
            self.runner.admit(req)
            self.running.append(req)
            new.append(req)
        self.prefill += new
        return new

    def fits(self, req: Req) -> bool:
        """Whether req can start now: a request slot is free, and the free pages not yet promised to
        running requests cover every page req may need. From chapter 21, with a new_token_ratio, by what
        it needs now: the rest of what it fills and that share of the tokens it may still make, each
        running request counted the same way (planned)."""
        # >>> ch21: admission by need
        if self.new_token_ratio is not None:
            promised = sum(map(self.planned, self.running))
            return self.runner.free_rows > 0 and self.cache.available_size - promised >= self.planned(req)
        # <<< ch21
        # >>> exercise 04.1: admission
        promised = sum(self.runner.pages_needed(r) - len(r.pages) for r in self.running)
        # >>> ch17 replaces ch04: the pages of its cached prefix are not needed again
        #| return self.runner.free_rows > 0 and self.cache.available_size - promised >= self.runner.pages_needed(req)
        return self.runner.free_rows > 0 and self.cache.available_size - promised >= self.runner.pages_needed(req) - len(req.pages)
        # <<< ch17
        # <<< exercise 04.1

    # >>> ch21: admission by need

    def planned(self, req: Req) -> int:
        """The pages req is counted for beyond those it holds (retraction.growth_pages)."""
        return growth_pages(self.runner.allocator.pages_for, req, self.runner.tokens_needed(req), self.new_token_ratio)
    # <<< ch21

    def step_kind(self, decode: list[Req]) -> tuple[ForwardMode, list[Req]]:
        """A prefill step if any prompt runs, else a decode step of `decode` (the running requests that may
        take one). From chapter 18, with mixed_chunk a prefill step carries the decode rows too, after the
        prompts (the step writes its prompt tokens, the first): one-token extends, as SGLang's
        mix_with_running makes them (its ForwardMode.MIXED)."""
        # >>> ch18: a mixed step
        if self.prefill and self.mixed_chunk:
            return ForwardMode.EXTEND, self.prefill + decode
        # <<< ch18
        return (ForwardMode.EXTEND, self.prefill) if self.prefill else (ForwardMode.DECODE, decode)
