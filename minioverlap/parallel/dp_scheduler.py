# >>> ch20 file: the scheduler of a rank under DP attention
"""The scheduler of a rank under DP attention: requests of its own, and a step agreed with the other ranks.

With tensor parallelism every rank holds every request, and the ranks agree because they hold the same
state. Under DP attention (dp_attention.py) each rank holds its own requests, its own KV pool and slot
table, its own relay, fence and hazard checker, and computes attention alone; only the MLP of each layer
runs over every rank's tokens at once. So the ranks cannot simply decide alike: they must tell each other
what they hold and what they are about to run. Each iteration has three exchanges, all over the CPU group:

    before it       rank 0's inbox to every rank (as with tensor parallelism: RankScheduler.shared_busy);
                    then every rank's [busy, load, handles first]: the run goes on while any rank has
                    work, each new request goes to the least loaded rank, decided alike on every rank
                    (`assign`), and if a drafter makes any rank handle its step in flight before it
                    builds the next, every rank does (`overlap_loop`)
    before a step   every rank's token count for the step it scheduled (`agree`): if all are 0 there is
                    no step; else every rank runs one, each MLP padded to the largest count, and a rank
                    with nothing to run runs the empty batch (`run_empty_batch`)
    after it        every rank's replies, gathered on rank 0 (`gather_replies`), the only rank with callers

In the overlap loop the agreement on step N+1 and the replies of step N are exchanged while step N+1
runs on the device, as the inbox is: the exchanges cost host time the device does not wait for.

References: SGLang's scheduler under --enable-dp-attention (prepare_mlp_sync_batch: each rank's token
count, forward mode and whether its graphs fit, all-gathered before every batch; an idle rank runs an
IDLE batch) and its data_parallel_controller (requests spread over the ranks; "shortest_queue" sends a
request to the rank with the fewest).
"""

from __future__ import annotations

from collections import deque

from minioverlap.engine.forward_batch import ForwardBatch
from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.parallel.group import TPGroup
from minioverlap.scheduler.output_processor import Reply
from minioverlap.parallel.rank_scheduler import RankScheduler, checksum

class DPScheduler(RankScheduler):
    """Scheduler for one rank of a DP-attention engine (LLM(tp_size=N, dp_attention=True)). Its loops are
    RankScheduler's; what differs is who holds which request, and the exchanges that keep the ranks' steps
    paired."""

    def __init__(self, runner, group: TPGroup) -> None:
        super().__init__(runner)
        self.group = group
        self.mine: dict[int, Req] = {}      # the requests this rank serves, until they finish
        self.remote: dict[int, Req] = {}    # rank 0: its copies of those the other ranks serve
        self.all_handle_first = False       # this iteration, every rank handles its step in flight first

    def fingerprint(self, inbox: list) -> int:
        """Every rank takes the same inbox and holds requests of its own: the inbox alone is compared."""
        return checksum(inbox, [])

    def busy_anywhere(self, last: StepOutput | None) -> bool:
        """After the inbox is shared: every rank's [busy, load, handles first]. The run goes on while any rank
        is busy (requests queued or running, a step in flight) or a request arrives; this rank keeps the new
        requests `assign` gives it (by load: requests queued and running); and if any rank must handle its
        step in flight before it builds the next (a drafter's, chapter 19), every rank does (overlap_loop)."""
        here = bool(self.grammars.queue or self.waiting or self.running) or last is not None
        first = last is not None and self.runner.waits_for_host(self.running)
        load = len(self.grammars.queue) + len(self.waiting) + len(self.running)
        ranks = self.group.all_gather_ints([int(here), load, int(first)])
        self.all_handle_first = any(first for _, _, first in ranks)
        arrived = self.keep_own([load for _, load, _ in ranks])
        return any(busy for busy, _, _ in ranks) or arrived

    def idle(self) -> bool:
        """Rank 0 may wait a moment for a grammar's compile only if no rank serves a request: the others'
        steps would wait with it."""
        return super().idle() and not self.remote

    def keep_own(self, loads: list[int]) -> bool:
        """The shared inbox, less the new requests `assign` gives to other ranks (rank 0 keeps a copy of
        those), in its order. Whether any request arrived."""
        adds = [req for kind, req in self.inbox if kind == "add"]
        owners = dict(zip([r.uid for r in adds], assign(len(adds), loads)))
        shared, self.inbox = self.inbox, deque()
        for kind, item in shared:
            if kind != "add" or owners[item.uid] == self.group.tp_rank:
                self.inbox.append((kind, item))
        self.mine.update((r.uid, r) for r in adds if owners[r.uid] == self.group.tp_rank)
        if not self.following:
            self.remote.update((r.uid, r) for r in adds if owners[r.uid] != self.group.tp_rank)
        return bool(adds)

    def schedule(self) -> ForwardBatch | None:
        """This rank's batch, then the agreement on the step (`agree`): None where no rank has one; else this
        rank's batch, or the empty batch run now where it has none."""
        batch = super().schedule()
        max_tokens = self.agree(batch)
        if max_tokens and batch is None:
            self.step += 1
            self.run_empty_batch()
        return batch

    def agree(self, batch: ForwardBatch | None) -> int:
        """Every rank's token count for the coming step, gathered: the largest, to which each rank pads its
        MLP rows (0: no rank runs a step)."""
        # >>> exercise 20.3: the agreement before a step
        counts = [n for [n] in self.group.all_gather_ints([sum(batch.extend_lens) if batch else 0])]
        max_tokens = max(counts)
        if max_tokens:
            self.runner.model.set_max_tokens(max_tokens)
            self.trace.record("agree", self.step + (batch is None), counts)
        return max_tokens
        # <<< exercise 20.3

    def run_empty_batch(self) -> None:
        """The step of a rank with nothing to run: the runner runs the model over no tokens, which joins every
        layer's MLP collectives, so that the ranks with tokens find this one in each."""
        self.runner.run_empty_batch()
        self.trace.record("idle", self.step, [])

    def normal_loop(self) -> list[Reply]:
        return self.gather_replies(super().normal_loop())

    def overlap_loop(self, last: StepOutput | None) -> tuple[StepOutput | None, list[Reply]]:
        """Scheduler's, but where any rank must handle its step in flight first, every rank only handles its
        own (if it has one) and none launches: a rank that launched would meet no partner in its MLPs."""
        if self.all_handle_first:
            replies = [] if last is None else self.wait_and_process(last)
            return None, self.gather_replies(replies)
        out, replies = super().overlap_loop(last)
        return out, self.gather_replies(replies)

    def wait_and_process(self, out: StepOutput) -> list[Reply]:
        self.wait(out)
        return self.process(out)

    def gather_replies(self, replies: list[Reply]) -> list[Reply]:
        """Every rank's replies of this iteration, on rank 0 (in rank order; [] on the others). Rank 0 writes
        the other ranks' into its copies of their requests, for what it returns to its callers."""
        for reply in replies:
            if reply.finished:
                del self.mine[reply.uid]
        everyone = self.group.all_gather_object(replies)
        if self.following:
            return []
        for rank_replies in everyone[1:]:
            for reply in rank_replies:
                self.mirror(reply)
        return [reply for rank_replies in everyone for reply in rank_replies]

    def mirror(self, reply: Reply) -> None:
        """Rank 0's copy of another rank's request, brought up to its reply: its tokens, logprobs, verify
        steps and cached prompt tokens, and how it finished."""
        req = self.remote[reply.uid]
        req.output_ids.extend(reply.token_ids)
        req.logprobs.extend(reply.logprobs or [])
        req.verify_steps, req.cached_tokens = reply.verify_steps, reply.cached_tokens
        if reply.finished:
            req.finish_reason, req.error = reply.finish_reason, reply.error
            del self.remote[reply.uid]

    def abandon(self) -> None:
        """Scheduler.abandon on this rank's own requests; rank 0 forgets the others' (their ranks abandon
        theirs, told as every rank is)."""
        super().abandon()
        self.mine.clear()
        self.remote.clear()


def assign(count: int, loads: list[int]) -> list[int]:
    """The rank of each of `count` new requests, in order: each to the least loaded rank (the lowest of
    those tied), counting the ones given before it. Every rank computes the same from the same loads."""
    loads, owners = list(loads), []
    for _ in range(count):
        rank = loads.index(min(loads))
        owners.append(rank)
        loads[rank] += 1
    return owners
