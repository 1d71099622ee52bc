# >>> ch20 file: the judge's own test of exercise 20.2
"""Exercise 20.2, judged in one process: the agreement before every iteration, on a following rank.

With several ranks, RankScheduler.goes_on asks shared_busy, and every rank's scheduler must answer alike:
first its inbox becomes rank 0's (scheduler.share, the broadcast over the CPU group; rank 1 and on ignore
their own), then the answer follows from state that is the same everywhere. Here a RankScheduler over one
engine's runner plays a following rank, and its `share` is a fake that plays rank 0: it returns a prepared
inbox (requests made by the engine, aborts, and the three messages rank 0 sends between runs: abandon,
stop, traces) and records what the rank offered. No process starts.

    python practice/judge.py test 20.2
"""

from __future__ import annotations

from collections import deque

import pytest

from minioverlap import LLM, SamplingParams
from minioverlap.parallel.rank_scheduler import RankScheduler

PROMPTS = ["def fibonacci(n):", [5, 6, 7], "import os\n" * 3]


class Rank0:
    """Rank 0, as a following rank's `share` sees it: each call returns the next prepared inbox (then
    empty ones), and keeps what the rank offered of its own. (Across processes each request would arrive as
    a copy, given its own matcher and decoder: ranks.received; here the rank gets the very objects.)"""

    def __init__(self, *inboxes: list) -> None:
        self.inboxes, self.offered = list(inboxes), []

    def __call__(self, items: list) -> list:
        self.offered.append(list(items))
        inbox = self.inboxes.pop(0) if self.inboxes else []
        return list(inbox)


@pytest.fixture
def llm():
    llm = LLM(overlap=False, max_running=2)
    one = llm.scheduler
    llm.scheduler = RankScheduler(llm.runner)
    llm.scheduler.chunked_prefill_size, llm.scheduler.mixed_chunk = one.chunked_prefill_size, one.mixed_chunk
    llm.scheduler.following = True
    llm.scheduler.sent = 0

    def send_trace():
        llm.scheduler.sent += 1
    llm.scheduler.send_trace = send_trace
    return llm


def follow(llm: LLM, *inboxes: list) -> Rank0:
    rank0 = Rank0(*inboxes)
    llm.scheduler.share = rank0
    return rank0


def requests(llm: LLM, n: int = 3, max_tokens: int = 8) -> list:
    return llm.make_requests(PROMPTS[:n], SamplingParams(max_tokens=max_tokens))


def start(llm: LLM, reqs: list) -> None:
    """One iteration of the normal loop, without ranks: the first requests admitted and prefilled (running),
    the one past max_running left waiting."""
    llm.scheduler.submit(reqs)
    with llm.scheduler.runner.schedule_stream():
        llm.scheduler.normal_loop()


def test_the_inbox_becomes_rank_0_s_and_the_rank_s_own_is_dropped(llm):
    scheduler = llm.scheduler
    own = requests(llm, 1)
    scheduler.submit(own)                                 # this rank's own inbox: rank 0's callers are not its
    theirs = requests(llm, 2)
    rank0 = follow(llm, [("add", theirs[0]), ("abort", 3), ("add", theirs[1])])
    assert scheduler.shared_busy(None) is True
    assert rank0.offered == [[("add", own[0])]], "the rank offers its own inbox to share, once per iteration"
    kinds = [(kind, item.uid if kind == "add" else item) for kind, item in scheduler.inbox]
    assert kinds == [("add", theirs[0].uid), ("abort", 3), ("add", theirs[1].uid)], \
        f"the inbox must be exactly what rank 0 shared, in its order: {kinds}"
    assert isinstance(scheduler.inbox, deque), "the inbox stays a deque: receive pops from its left"


def test_the_answer_is_whether_a_request_is_queued_or_running_or_a_step_in_flight(llm):
    scheduler = llm.scheduler
    follow(llm)
    assert scheduler.shared_busy(None) is False, "nothing queued, running or in flight: the run ends"
    assert scheduler.shared_busy(object()) is True, "a step still in flight must be handled: the run goes on"

    reqs = requests(llm)
    follow(llm, [("add", r) for r in reqs])
    assert scheduler.shared_busy(None) is True, "requests arrived: the run goes on"

    follow(llm, [("abort", 0)])
    assert scheduler.shared_busy(None) is True, "an abort arrived: the next iteration must receive it on every rank"

    scheduler.inbox.clear()
    start(llm, reqs)
    assert scheduler.running and scheduler.waiting
    follow(llm)
    assert scheduler.shared_busy(None) is True, "requests are running and waiting: the run goes on"
    for req in list(scheduler.waiting):
        scheduler.abort_now(req)
    assert scheduler.shared_busy(None) is True, "requests are running: the run goes on"
    for req in list(scheduler.running):
        scheduler.abort_now(req)
    assert scheduler.shared_busy(None) is False
    scheduler.check_integrity()


def test_stop_ends_the_rank_s_runs(llm):
    scheduler = llm.scheduler
    follow(llm, [("stop", None)], [])
    assert scheduler.shared_busy(None) is False, "told to stop, a rank ends its run"
    assert scheduler.stopped is True, "told to stop, a rank sets `stopped`: follow runs no more runs"
    assert scheduler.shared_busy(None) is False
    assert scheduler.stopped is False, "`stopped` says what the last shared inbox said"


def test_a_following_rank_told_to_abandon_aborts_everything(llm):
    scheduler = llm.scheduler
    reqs = requests(llm)
    start(llm, reqs)
    assert scheduler.running and scheduler.waiting
    rank0 = follow(llm, [("abandon", None)])
    assert scheduler.shared_busy(None) is False, "rank 0's caller left: the run ends on every rank"
    assert not scheduler.waiting and not scheduler.running, "an abandoned run leaves nothing queued or running"
    assert all(r.finish_reason == "abort" for r in reqs)
    assert len(rank0.offered) == 1, "a following rank abandons where it is: it shares nothing more"
    scheduler.check_integrity()
    follow(llm, [("add", r) for r in requests(llm, 1)])      # the next run is as a fresh engine's
    outs = [r for r in scheduler.run(False)]
    assert outs and outs[-1].finished
    scheduler.check_integrity()


def test_traces_sends_the_last_run_s_trace_and_runs_nothing(llm):
    scheduler = llm.scheduler
    follow(llm, [("traces", None)])
    assert scheduler.shared_busy(None) is False, "asked for its trace between runs, a rank runs nothing"
    assert scheduler.sent == 1, "a following rank asked for its trace sends it (send_trace), once"
    follow(llm, [("add", r) for r in requests(llm, 1)])
    assert scheduler.shared_busy(None) is True
    assert scheduler.sent == 1, "an ordinary iteration sends no trace"


def test_an_ordinary_iteration_records_a_share_event(llm):
    scheduler = llm.scheduler
    reqs = requests(llm, 2)
    scheduler.step = 4
    follow(llm, [("add", reqs[0]), ("abort", 0), ("add", reqs[1])])
    assert scheduler.shared_busy(None) is True
    shares = [e for e in scheduler.trace if e.kind == "share"]
    assert len(shares) == 1, f"one share event per ordinary iteration, got {len(shares)}"
    assert shares[0].step == 5 and shares[0].uids == (reqs[0].uid, reqs[1].uid), \
        f"the share event belongs to the next step (5) and names the requests shared: {shares[0]}"


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_following_rank_runs_rank_0_s_requests_to_one_engine_s_tokens(llm, overlap):
    params = SamplingParams(max_tokens=8)
    want = [o.token_ids for o in LLM(overlap=False, max_running=2).generate(PROMPTS, params)]
    reqs = llm.make_requests(PROMPTS, params)
    rank0 = follow(llm, [("add", reqs[0]), ("add", reqs[1])], [], [("add", reqs[2])])
    for _ in llm.scheduler.run(overlap):
        pass
    crossed = [item for inbox in rank0.offered for kind, item in inbox]
    assert not crossed, "a following rank's own inbox is empty: its requests come from rank 0"
    assert [len(r.output_ids) for r in reqs] == [8, 8, 8]
    assert [r.output_ids for r in reqs] == want
    assert len(rank0.offered) == len([e for e in llm.scheduler.trace if e.kind == "share"]), \
        "every iteration shares once, and records it"
    llm.scheduler.check_integrity()
