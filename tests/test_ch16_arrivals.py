# >>> ch16 file: requests that arrive while the loop runs
"""The receive step made real: Scheduler.run(overlap, receive) calls `receive` at the top of every
iteration, as a server's scheduler process does. A request that the receive step takes while step N is
in flight joins the next step the loop launches, N+1, in both loops; in the overlap loop its prefill's
token is handled only after step N+2 is launched. (On a GPU the overlap loop launches N+1 early in step
N, so a request that arrives later in step N waits for N+2.) Tokens do not depend on when a request
arrives; an abort that arrives while the request's last step is in flight frees it once (the double
free of mini-sglang's open PR #111)."""

from __future__ import annotations

import random

import pytest

from minioverlap.llm import LLM
from minioverlap.sampling_params import SamplingParams
from tests.conftest import CODE_PROMPTS

KINDS = ("receive", "launch", "process")


def run_with_arrivals(llm: LLM, first: list, arrivals: dict[int, list], stop_at: int | None = None,
                      first_tokens_first: bool = False) -> list:
    """Run the loop with `first` queued; after iteration i (counting from 1) has replied, `arrivals[i]`
    reaches the inbox, for iteration i + 1: a Req is added, an int is an abort of that uid. `stop_at`:
    receive says stop after that iteration."""
    calls = 0

    def receive() -> bool:
        nonlocal calls
        calls += 1
        for item in arrivals.get(calls, []):
            llm.scheduler.abort(item) if isinstance(item, int) else llm.scheduler.add_request(item)
        return calls != stop_at

    llm.scheduler.submit(first)
    return list(llm.scheduler.run(llm.args.overlap, receive, first_tokens_first))


def two_requests(llm: LLM) -> tuple:
    [a] = llm.make_requests(["def fibonacci(n):"], SamplingParams(max_tokens=4, ignore_eos=True))
    [b] = llm.make_requests(["import os\n"], SamplingParams(max_tokens=2, ignore_eos=True))
    return a, b


def test_in_the_normal_loop_an_arrival_joins_the_next_step():
    """B arrives while step 2 runs (the inbox takes it after iteration 2): its prefill is step 3,
    and its first token is handled right after."""
    llm = LLM("tiny", overlap=False)
    a, b = two_requests(llm)
    run_with_arrivals(llm, [a], {2: [b]})
    assert llm.trace.order(KINDS) == ["launch 1", "handle 1", "launch 2", "handle 2", "receive 2",
                                      "launch 3", "handle 3", "launch 4", "handle 4", "launch 5", "handle 5"]
    assert [e.uids for e in llm.trace if e.kind == "schedule"] == [(0,), (0,), (1,), (0, 1), (0,)]


def test_in_the_overlap_loop_an_arrival_joins_the_next_launch_and_its_token_waits_one_more():
    """B arrives while step 2 runs: step 2 was launched without it, and step 3 is its prefill; step 3's
    token is handled only after step 4 is launched. B's first token comes one launch later than in the
    normal loop: the price of overlap for a new request's time to first token."""
    llm = LLM("tiny", overlap=True)
    a, b = two_requests(llm)
    run_with_arrivals(llm, [a], {2: [b]})
    assert llm.trace.order(KINDS) == ["launch 1", "launch 2", "handle 1", "receive 2", "launch 3", "handle 2",
                                      "launch 4", "handle 3", "launch 5", "handle 4", "handle 5"]
    assert [e.uids for e in llm.trace if e.kind == "schedule"] == [(0,), (0,), (1,), (0, 1), (0,)]


def test_first_tokens_first_handles_a_prefill_before_the_next_launch():
    """With first_tokens_first the overlap loop handles each prefill (A's step 1, B's step 2) before it
    launches the next step: the first tokens go out as in the normal loop; the decode steps (3-5)
    still overlap. B arrives after iteration 2, the one that only handled step 1."""
    llm = LLM("tiny", overlap=True)
    a, b = two_requests(llm)
    run_with_arrivals(llm, [a], {2: [b]}, first_tokens_first=True)
    assert llm.trace.order(KINDS) == ["launch 1", "handle 1", "receive 1", "launch 2", "handle 2",
                                      "launch 3", "launch 4", "handle 3", "launch 5", "handle 4", "handle 5"]
    assert [e.uids for e in llm.trace if e.kind == "schedule"] == [(0,), (1,), (0, 1), (0,), (0,)]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("mtp", [0, 2], ids=["plain", "mtp2"])
@pytest.mark.parametrize("first", [False, True], ids=["", "first-tokens-first"])
def test_tokens_do_not_depend_on_when_requests_arrive(overlap, mtp, first):
    """Requests arriving at random iterations get the tokens a fresh engine gives them all at once."""
    params = [SamplingParams(max_tokens=n) for n in (12, 5, 9, 16, 7)]
    expected = [o.token_ids for o in LLM("tiny").generate(CODE_PROMPTS, params)]
    llm = LLM("tiny", overlap=overlap, mtp_steps=mtp, max_running=3)
    reqs = llm.make_requests(CODE_PROMPTS, params)
    rng = random.Random(16)
    arrivals: dict[int, list] = {}
    for req in reqs[1:]:
        arrivals.setdefault(rng.randrange(1, 12), []).append(req)
    replies = run_with_arrivals(llm, reqs[:1], arrivals, first_tokens_first=first)
    got = {req.uid: [] for req in reqs}
    for reply in replies:
        got[reply.uid] += reply.token_ids
    assert [got[req.uid] for req in reqs] == expected
    assert sum(1 for e in llm.trace if e.kind == "receive") == len(arrivals)
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_receive_saying_stop_aborts_what_is_left(overlap):
    """The server stops mid-run: the run ends, nothing stays queued, running, in flight or held."""
    llm = LLM("tiny", overlap=overlap, max_running=2)
    reqs = llm.make_requests(CODE_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    run_with_arrivals(llm, reqs[:3], {2: reqs[3:]}, stop_at=4)
    sched = llm.scheduler
    assert not (sched.busy or sched.in_flight or sched.deferred)
    llm.check_integrity()
    assert llm.runner.free_pages == llm.runner.usable_pages and llm.runner.free_rows == llm.max_running
    assert llm.generate(CODE_PROMPTS[0], SamplingParams(max_tokens=8))[0].token_ids == \
        LLM("tiny").generate(CODE_PROMPTS[0], SamplingParams(max_tokens=8))[0].token_ids


def test_an_abort_that_arrives_with_the_last_step_in_flight_ends_the_request_once():
    """A (3 tokens) has its last step, 3, in flight when its client's abort arrives (after iteration 3, before
    step 3 is handled): the abort frees it; step 3's token then changes nothing. One last reply, one
    free: the double free that mini-sglang's PR #111 (open) reports here, chapter 07's stale-reply in a real server."""
    llm = LLM("tiny", overlap=True)
    [a] = llm.make_requests(["def fibonacci(n):"], SamplingParams(max_tokens=3, ignore_eos=True))
    [b] = llm.make_requests(["import os\n"], SamplingParams(max_tokens=6, ignore_eos=True))
    replies = run_with_arrivals(llm, [a, b], {3: [a.uid]})
    last = [r for r in replies if r.uid == a.uid and r.finished]
    assert [(r.finish_reason, r.token_ids) for r in last] == [("abort", [])]
    assert sum(len(r.token_ids) for r in replies if r.uid == a.uid) == 2     # steps 1 and 2 were handled
    assert sum(len(r.token_ids) for r in replies if r.uid == b.uid) == 6
    llm.check_integrity()
    assert llm.runner.free_rows == llm.max_running and llm.runner.free_pages == llm.runner.usable_pages


def test_a_server_s_run_keeps_only_the_last_events(monkeypatch):
    """A server's run lasts its whole busy period: its trace keeps the last TRACE_EVENTS events (once it
    holds twice that many), so that memory does not grow with the run. Tokens are unchanged."""
    from minioverlap.scheduler import scheduler

    monkeypatch.setattr(scheduler, "TRACE_EVENTS", 20)
    llm = LLM("tiny", overlap=True)
    [a] = llm.make_requests(["def fibonacci(n):"], SamplingParams(max_tokens=40, ignore_eos=True))
    replies = run_with_arrivals(llm, [a], {})
    assert 20 <= len(llm.trace) < 40 and llm.trace[-1].kind == "reply" and llm.trace[-1].step == 40
    assert [t for r in replies for t in r.token_ids] == \
        LLM("tiny").generate("def fibonacci(n):", SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
