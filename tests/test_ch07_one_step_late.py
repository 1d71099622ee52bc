"""Chapter 07: results arrive one step late. The four bugs this causes, each pinned by a test that
fails on the naive logic (the step checker reverts each fix and watches its test fail), and a
randomized test: the overlap loop gives every client exactly what the normal loop gives."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from conftest import run_example
from minioverlap import LLM, SamplingParams
# >>> ch08: the guards
from minioverlap.config import Guards
# <<< ch08


# ---- helpers: a client that streams, and a watch on slots handed out while a step uses them

def watched(**options) -> tuple[LLM, list[str]]:
    """An engine of the tiny model with chapter 07's guard, and a watch on it that records every request
    slot or page handed out while a launched, unhandled step still uses it. On a GPU that step may still
    be reading or writing it: the new owner's data would be corrupted."""
    # >>> ch08: from chapter 08 the engine releases a slot at once, behind the fence; ask for chapter 07's guard
    options["guards"] = Guards(defer_release=True)
    # <<< ch08
    llm = LLM(model="tiny", **options)
    sched, tables, alloc = llm.scheduler, llm.runner.tables, llm.runner.allocator
    take_row, take_pages, violations = tables.alloc, alloc.alloc, []

    def row_alloc() -> int:
        row = take_row()
        violations.extend([f"request slot {row} handed out while step {o.step} uses it"
                           for o in sched.in_flight if row in o.batch.rows])
        return row

    def page_alloc(n: int) -> list[int]:
        pages = take_pages(n)
        violations.extend([f"page {p} handed out while step {o.step} uses it"
                           for o in sched.in_flight for p in pages if p in o.batch.pages])
        return pages

    tables.alloc, alloc.alloc = row_alloc, page_alloc
    return llm, violations


@dataclass
class Plan:
    """One client: its prompt and params, when it arrives (after how many replies in all), and
    after how many of its own tokens it aborts (None: never)."""
    prompt: list[int]
    params: SamplingParams
    arrive_after: int = 0
    abort_after: int | None = None


@dataclass
class Received:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    replies_after_finish: int = 0


def run_clients(llm: LLM, plans: list[Plan]) -> list[Received]:
    """Drive llm.stream like a set of clients: arrivals and aborts happen between replies. A client
    that would arrive after the last reply arrives then, in a stream of its own."""
    got = [Received() for _ in plans]
    uid_to: dict[int, int] = {}
    arrivals = sorted(range(len(plans)), key=lambda i: plans[i].arrive_after)
    count = 0
    while arrivals:
        first = [arrivals.pop(0)]
        while arrivals and plans[arrivals[0]].arrive_after <= count:
            first.append(arrivals.pop(0))
        stream = llm.stream([plans[i].prompt for i in first], [plans[i].params for i in first])
        uid_to.update({llm.next_uid - len(first) + k: i for k, i in enumerate(first)})
        for reply in stream:
            count += 1
            i = uid_to[reply.uid]
            got[i].replies_after_finish += got[i].finish_reason is not None
            got[i].tokens += reply.token_ids
            if reply.finished:
                got[i].finish_reason = reply.finish_reason
            elif plans[i].abort_after is not None and len(got[i].tokens) >= plans[i].abort_after:
                llm.abort(reply.uid)
            while arrivals and plans[arrivals[0]].arrive_after <= count:
                j = arrivals.pop(0)
                uid_to[llm.add_request(plans[j].prompt, plans[j].params)] = j
    return got


def stop_token_after(llm: LLM, prompt: list[int], n: int) -> int:
    """The token greedy decoding produces as the n-th new token of prompt (normal loop)."""
    normal = LLM(model="tiny", overlap=False)
    return normal.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids[n - 1]


# ---- the four bugs

def test_early_finish_a_client_gets_all_max_tokens():
    """early-finish: in the overlap loop a request with max_tokens=5 streams 5 tokens, `finished` on the
    fifth. The naive check reads the launched length, one step ahead, and stops the client at 4."""
    llm = LLM(model="tiny", overlap=True)
    replies = list(llm.stream(["def f(x):"], SamplingParams(max_tokens=5, ignore_eos=True)))
    assert [len(r.token_ids) for r in replies] == [1, 1, 1, 1, 1]
    assert [r.finished for r in replies] == [False] * 4 + [True] and replies[-1].finish_reason == "length"
    llm.check_integrity()


def test_stale_reply_nothing_after_the_stop_token():
    """stale-reply: a request that samples a stop token at step N is already in step N+1; that step's
    token for it must produce no reply. The client's stream ends with the stop token."""
    llm = LLM(model="tiny", overlap=True)
    prompt = llm.encode("def fibonacci(n):")
    stop = stop_token_after(llm, prompt, 3)
    got = run_clients(llm, [Plan(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))])
    greedy = LLM(model="tiny", overlap=False).generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert got[0].replies_after_finish == 0
    assert got[0].finish_reason == "stop"
    assert got[0].tokens == greedy.token_ids[:greedy.token_ids.index(stop) + 1], "the greedy tokens up to the stop token"
    llm.check_integrity()


def test_slot_reuse_no_slot_is_handed_out_while_a_step_uses_it():
    """slot-reuse: with one request slot, request A stops on a stop token at step N while step N+1
    (which writes A's row) is in flight. Request B must not get that row before step N+1 is handled."""
    llm, violations = watched(overlap=True, max_running=1, page_size=4)
    a, b = llm.encode("def fibonacci(n):"), llm.encode("class Stack:")
    stop = stop_token_after(llm, a, 3)
    got = run_clients(llm, [Plan(a, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,))),
                            Plan(b, SamplingParams(max_tokens=6, ignore_eos=True))])
    assert violations == []
    assert got[0].finish_reason == "stop" and got[1].finish_reason == "length" and len(got[1].tokens) == 6
    llm.check_integrity()


def test_abort_in_flight_frees_once_and_discards_the_result():
    """abort-in-flight: an abort that arrives after A's prefill was launched, before its result is
    handled, frees A exactly once (and not while the prefill still uses its slot) and discards the
    prefill's token: A's only reply is the abort."""
    llm, violations = watched(overlap=True, max_running=1, page_size=4)
    sched = llm.scheduler
    released = []
    release = llm.runner.release
    llm.runner.release = lambda req: released.append(req.uid) or release(req)
    a, b = llm.make_requests(["def fibonacci(n):", "class Stack:"], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    last, replies = sched.overlap_loop(None)              # A's prefill is launched, B waits for the slot
    sched.abort(a.uid)                                    # ... and the abort arrives before it is handled
    while sched.busy or last is not None:
        last, more = sched.overlap_loop(last)
        replies += more
    assert [(r.token_ids, r.finish_reason) for r in replies if r.uid == a.uid] == [([], "abort")]
    assert a.output_ids == [] and released.count(a.uid) == 1
    assert violations == []
    assert len(b.output_ids) == 4 and b.finish_reason == "length"
    llm.check_integrity()


def test_a_stop_token_that_is_also_the_max_tokens_th_token_finishes_with_stop():
    """In the overlap loop too, when the n-th token is a stop token and max_tokens is n, the client's last
    reply carries exactly that token, `finished`, with finish_reason 'stop', not 'length'."""
    llm = LLM(model="tiny", overlap=True)
    prompt = llm.encode("def fibonacci(n):")
    greedy = LLM(model="tiny", overlap=False).generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    n = next(i + 1 for i in range(3, 16) if greedy.token_ids[i] not in greedy.token_ids[:i])   # new at its place
    got = run_clients(llm, [Plan(prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                        stop_token_ids=(greedy.token_ids[n - 1],)))])
    assert (got[0].tokens, got[0].finish_reason, got[0].replies_after_finish) == (greedy.token_ids[:n], "stop", 0)
    llm.check_integrity()


def test_slot_reuse_the_deferred_slot_comes_back_at_the_very_next_handle():
    """The deferred release's step: with one request slot, A stops at step N while step N+1 (which holds
    A's row) is in flight; the row comes back when step N+1 is handled, and B's prefill is the next
    step launched. Released one handle later, B would wait for a step that never comes: the scheduler
    says it is stalled (a RuntimeError), it does not hang."""
    llm, violations = watched(overlap=True, max_running=1, page_size=4)
    a, b = llm.encode("def fibonacci(n):"), llm.encode("class Stack:")
    stop = stop_token_after(llm, a, 3)
    got = run_clients(llm, [Plan(a, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,))),
                            Plan(b, SamplingParams(max_tokens=2, ignore_eos=True))])
    assert violations == [] and got[0].finish_reason == "stop" and len(got[1].tokens) == 2
    events = [(e.kind, e.step, e.uids) for e in llm.trace if e.kind in ("launch", "process")]
    a_steps = [step for kind, step, uids in events if kind == "launch" and uids == (0,)]
    b_prefill = next(step for kind, step, uids in events if kind == "launch" and uids == (1,))
    assert b_prefill == a_steps[-1] + 1, "B's prefill is the first step after the last one that held A's row"
    launch_b = events.index(("launch", b_prefill, (1,)))
    assert events[launch_b - 1] == ("process", a_steps[-1], (0,)), "... launched right after that step is handled"
    llm.check_integrity()


# ---- everything at once: random schedules

def random_plans(rng: random.Random, stops: list[int], *, clients: int = 6, max_tokens: int = 14,
                 prompt_len: int = 24, arrive: int = 12, abort: int = 6) -> list[Plan]:
    """2..clients clients; each limit is the largest value drawn for that choice."""
    plans = []
    for i in range(rng.randint(2, clients)):
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True,
                                stop_token_ids=tuple(rng.sample(stops, rng.randint(0, 2))),
                                temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randint(0, 999))
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(1, prompt_len))]
        plans.append(Plan(prompt, params, arrive_after=0 if i < 2 else rng.randint(1, arrive),
                          abort_after=rng.choice([None, None, rng.randint(1, abort)])))
    return plans


@pytest.mark.parametrize("seed", range(10))
def test_random_schedules_overlap_equals_normal(seed):
    """Random arrivals, prompt lengths, max_tokens, stop tokens, aborts and small page pools: every
    client of the overlap loop receives exactly what it receives from the normal loop, `finished` on
    the last reply and nothing after; no slot is reused while in flight; integrity holds."""
    rng = random.Random(seed)
    engine = dict(page_size=rng.choice([1, 2, 4, 16]), max_running=rng.randint(1, 4), max_seq_len=64)
    engine["num_pages"] = 64 // engine["page_size"] * rng.randint(1, 3) + 1
    tiny = LLM(model="tiny", **engine, overlap=False)
    stops = [tiny.encode(s)[0] for s in ("\n", "(", " =", ":", ",")]
    plans = random_plans(rng, stops)
    results = {}
    for overlap in (False, True):
        llm, violations = watched(**engine, overlap=overlap)
        results[overlap] = run_clients(llm, plans)
        assert violations == []
        llm.check_integrity()
        for got in results[overlap]:
            assert got.finish_reason is not None and got.replies_after_finish == 0
    assert results[True] == results[False]


@pytest.mark.process
def test_the_example_shows_the_naive_replies_against_the_fixed_ones():
    """`python examples/ch07_one_step_late.py`: with max_tokens=5 the naive handling marks the fourth
    reply finished (early-finish), the fixed one the fifth; after the stop token the naive handling
    sends one more reply (stale-reply), the fixed one ends on the stop token."""
    import re
    out = run_example("examples/ch07_one_step_late.py")
    replies = [line.split(":", 1)[1].split() for line in out.splitlines() if line.strip().startswith(("naive:", "fixed:"))]
    naive, fixed, naive_stop, fixed_stop = replies
    assert [r.endswith("*") for r in fixed] == [False] * 4 + [True]
    assert [r.endswith("*") for r in naive][:4] == [False] * 3 + [True]
    stop = re.search(r"^stop token (\d+) \(the 4th token\)", out, re.MULTILINE)[1]
    assert fixed_stop == fixed[:3] + [stop + "*"]
    assert naive_stop[3] == stop + "*" and len(naive_stop) == 5
