# >>> ch20 file: the scheduler of a rank under tensor parallelism
"""The scheduler of a rank under tensor parallelism: one inbox for every rank, and the same answers.

Every rank runs its own Scheduler over its shard of the model, and every rank must run the same batch
at the same step: a collective in a layer that one rank reaches and another does not waits for ever.
So before every iteration rank 0's inbox (what its callers sent since the last one: requests, aborts,
compiled grammars) becomes every rank's (`shared_busy`, over the CPU group); from the same requests in
the same state, with generators seeded alike, every rank decides alike. The exchange also compares a
checksum of what each rank holds (`fingerprint`, compared in minioverlap/ranks.py), so that ranks that
parted anyway are found before their next batch.

Under DP attention the ranks hold requests of their own and agree more often: DPScheduler
(dp_scheduler.py), a RankScheduler.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Callable

from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.scheduler.scheduler import Scheduler


class RankScheduler(Scheduler):
    """Scheduler for one rank of an engine over several (LLM(tp_size=N)): its loops are Scheduler's; each
    iteration starts with the inbox every rank shares."""

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.share: Callable[[list], list] | None = None    # rank 0's inbox to every rank (LLM, ranks.py)
        self.following = False                  # a rank other than 0: it runs until rank 0 says stop
        self.stopped = False
        self.send_trace: Callable[[], None] | None = None     # a following rank's: its last run's trace to rank 0

    def goes_on(self, last: StepOutput | None) -> bool:
        """Whether the run goes on, the same answer on every rank (shared_busy); the grammars compiled since
        are announced first, in the inbox the ranks share."""
        self.grammars.announce()
        return self.shared_busy(last)

    def shared_busy(self, last: StepOutput | None) -> bool:
        """Whether the run goes on, the same answer on every rank. First every rank's inbox becomes rank 0's
        (what rank 0's callers sent since the last iteration: requests, aborts), over the CPU group; then
        every rank holds the same requests in the same state and answers alike (busy_anywhere). A following
        rank told to abandon (rank 0's caller left) abandons here too; one told to stop, stops."""
        # >>> exercise 20.2: the agreement before every iteration
        self.inbox = deque(self.share(list(self.inbox)))
        if self.following and ("abandon", None) in self.inbox:
            self.abandon()
            return False
        if self.following and ("traces", None) in self.inbox:
            self.send_trace()
            return False
        self.stopped = ("stop", None) in self.inbox
        self.trace.record("share", self.step + 1, [r.uid for kind, r in self.inbox if kind == "add"])
        return not self.stopped and self.busy_anywhere(last)
        # <<< exercise 20.2

    def busy_anywhere(self, last: StepOutput | None) -> bool:
        """Whether any rank has a request queued or running, or a step in flight. Every rank holds the same
        requests in the same state: this rank's answer is every rank's. (With DP attention each rank holds
        its own, and the ranks ask each other: DPScheduler.)"""
        return self.busy or last is not None

    def abandon(self) -> None:
        """Scheduler.abandon, on every rank: rank 0 tells the other ranks to abandon the run too, in the inbox
        they are waiting for."""
        if not self.following:
            self.inbox = deque(self.share([*self.inbox, ("abandon", None)]))
        super().abandon()

    def fingerprint(self, inbox: list) -> int:
        """A checksum of what every rank's scheduler must hold alike as an iteration starts: the inbox it is
        about to take (each request's and abort's uid), and each queued and running request's uid, its
        length in the cache and its tokens so far (how many, and the last). Ranks that sampled apart, or
        decided apart, differ here before their next batch is built; the exchange compares it
        (minioverlap/ranks.py). Nothing at all: 0."""
        return checksum(inbox, [*self.grammars.queue, *self.waiting, *self.running])


def checksum(inbox: list, reqs: list[Req]) -> int:
    """crc32 of the inbox's uids (each add's, abort's and compiled grammar's) and of each request's uid,
    length in the cache, token count and last token; 0 for nothing at all."""
    state = array("q")
    for kind, item in inbox:
        code = {"add": 1, "abort": 2, "grammar": 3}.get(kind)
        state.extend(() if code is None else (code, item.uid if kind == "add" else item))
    for r in reqs:
        state.extend((r.uid, r.seq_len, len(r.output_ids), r.output_ids[-1] if r.output_ids else -1))
    return zlib.crc32(state.tobytes())
