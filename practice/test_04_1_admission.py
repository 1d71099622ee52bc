# >>> ch04 file: the judge's own test of exercise 04.1
"""Exercise 04.1, judged on the admission alone: which waiting requests a step's PrefillAdder admits.

No step runs here: the engine's scheduler lays out one prefill step (schedule(), which gives its
requests their prompts' pages) and nothing more, so a running request holds only some of the pages it
may need. The adder must admit a waiting request only while a request slot is free and the free pages,
less every page still promised to the running requests, cover every page it may need; in order, the
first that does not fit waiting with every request behind it.

    python practice/judge.py test 04.1
"""

from __future__ import annotations

from collections import deque

from minioverlap import LLM, SamplingParams
from minioverlap.engine.request import Req
from minioverlap.scheduler.prefill_adder import PrefillAdder


def requests(llm: LLM, *sizes: tuple[int, int]) -> list[Req]:
    """A request of `prompt` tokens and `max_tokens` new ones for each (prompt, max_tokens)."""
    return [llm.make_requests([[7] * prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
            for prompt, max_tokens in sizes]


def admitted(llm: LLM, waiting: list[Req]) -> list[Req]:
    """What one adder admits of `waiting` beside the engine's running requests; `waiting` keeps the rest."""
    queue = deque(waiting)
    new = PrefillAdder(llm.runner, llm.scheduler.running).add_waiting(queue)
    waiting[:] = queue
    return new


def with_one_running(llm: LLM, prompt: int, max_tokens: int) -> Req:
    """The engine with one request running: admitted and its prefill laid out (its prompt's pages
    taken), not run."""
    [req] = requests(llm, (prompt, max_tokens))
    llm.scheduler.add_request(req)
    llm.scheduler.receive()
    assert llm.scheduler.schedule() is not None and llm.scheduler.running == [req]
    return req


def test_admission_stops_when_slots_run_out():
    """Two request slots, plenty of pages: of five small requests the first two are admitted, in order,
    and the other three wait; with both slots taken, the next adder admits no one."""
    llm = LLM(model="tiny", page_size=4, max_running=2)
    waiting = requests(llm, *[(3, 4)] * 5)
    first = list(waiting)
    assert admitted(llm, waiting) == first[:2]
    assert waiting == first[2:]
    assert llm.runner.free_rows == 0
    assert admitted(llm, waiting) == [] and waiting == first[2:]


def test_admission_stops_when_pages_run_out_keeping_the_pages_promised_to_running_requests():
    """Pages of 4 tokens, 11 free. A running request of 5 + 12 tokens may need 4 pages (5 + 12 - 1 = 16
    tokens) and holds the 2 of its prompt: 9 pages are free, 2 of them promised to it, 7 left to give.
    A request that may need 8 pages waits (9 free pages would cover it, but they are not all free to
    give); one that needs exactly 7 is admitted; a request behind one that waits waits too."""
    llm = LLM(model="tiny", page_size=4, num_pages=12, max_running=4)
    running = with_one_running(llm, 5, 12)
    runner = llm.runner
    assert (len(running.pages), runner.pages_needed(running), runner.free_pages) == (2, 4, 9)
    eight, seven, one = requests(llm, (20, 13), (5, 24), (1, 1))
    assert [runner.pages_needed(r) for r in (eight, seven, one)] == [8, 7, 1]
    waiting = [eight, one]
    assert admitted(llm, waiting) == [], "8 pages needed, 7 left once the running request's 2 are kept"
    assert waiting == [eight, one], "the requests wait in order: none is admitted past the first"
    waiting = [seven]
    assert admitted(llm, waiting) == [seven], "7 pages needed, exactly the 7 left"


def test_requests_admitted_by_one_adder_count_against_each_other():
    """Nothing running, 11 free pages, and none taken before the step is laid out: of requests that may
    need 6, 6 and 5 pages, the first is admitted and the second waits (5 pages left once the first's 6
    are promised to it), with the third behind it. The next adder admits the third alone: 5 pages, exactly
    what is left."""
    llm = LLM(model="tiny", page_size=4, num_pages=12, max_running=4)
    first, second, third = requests(llm, (4, 20), (4, 20), (4, 16))
    assert [llm.runner.pages_needed(r) for r in (first, second, third)] == [6, 6, 5]
    waiting = [first, second, third]
    assert admitted(llm, waiting) == [first]
    assert waiting == [second, third]
    waiting = [third]
    assert admitted(llm, waiting) == [third]
