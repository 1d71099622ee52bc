# >>> ch04 file: the scheduler's checks
"""The scheduler's checks: a request refused before it is queued, a loop that would wait forever, and the
account of every page and request slot. The Scheduler (scheduler.py) takes these methods from this class,
as SGLang's Scheduler takes its checks (check_memory: no KV slot lost or leaked once idle; the watchdog)
from SchedulerRuntimeCheckerMixin (managers/scheduler_runtime_checker_mixin.py).
"""

from __future__ import annotations

from minioverlap.engine.request import Req


class IntegrityError(RuntimeError):
    """A page, KV slot or request slot that is lost, or owned twice."""


class RuntimeCheckerMixin:
    """The checks of Scheduler."""

    def check_fits_pool(self, req: Req) -> None:
        """Refuse a request that could never fit the page pool, even alone."""
        pages, pool = self.runner.pages_needed(req), self.runner.usable_pages
        if pages > pool:
            raise ValueError(f"{self.runner.need(req)} need {pages} pages; the pool has {pool}")

    def check_stalled(self) -> None:
        """Nothing could be scheduled. If nothing is running either (and, from chapter 06, no step is in
        flight whose handling frees a slot), the waiting requests would wait forever: say so instead."""
        # >>> ch06 replaces ch04: a step in flight will be handled, and may free what they wait for
        #| stalled = self.waiting and not self.running
        stalled = self.waiting and not self.running and not self.in_flight
        # <<< ch06
        if stalled:
            raise RuntimeError(f"the scheduler is stalled: {len(self.waiting)} requests wait, none runs, and "
                               f"{self.runner.free_rows} request slots and {self.runner.free_pages} pages are free")

    def check_integrity(self) -> None:
        """Every page and request slot is free or owned by exactly one running request, and each
        running request's req_to_token row points at its own pages."""
        owners = list(self.running)
        # >>> ch07 fix slot-reuse: deferred requests still own theirs
        owners += [req for _, req in self.deferred]
        # <<< ch07
        problems = self.cache.integrity_problems(owners)
        # >>> ch21 replaces ch04: a request taken back with its release deferred owns them until then
        #| problems += [f"waiting request {r.uid} holds a slot or pages" for r in self.waiting if r.row or r.pages]
        problems += [f"waiting request {r.uid} holds a slot or pages" for r in self.waiting
                     if (r.row or r.pages) and r not in owners]
        # <<< ch21
        if problems:
            raise IntegrityError("; ".join(problems))
