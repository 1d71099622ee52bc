"""Chapter 04: the normal loop. Exact event order, admission that queues, stop rules, streaming,
abort, bad requests refused while others run, and integrity after every run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import CODE_PROMPTS, no_hang, normal_loop, random_checkpoint, run_example
from minioverlap import LLM, SamplingParams
from minioverlap.scheduler.checks import IntegrityError

GREEDY = SamplingParams(max_tokens=12)
NORMAL = normal_loop()          # these tests pin the normal loop (overlap=False where the stage's LLM takes it)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", page_size=4, **NORMAL)


@pytest.fixture(scope="module")
def solo(llm) -> dict[str, list[int]]:
    """Each code prompt's greedy tokens when it runs alone."""
    return {p: llm.generate([p], GREEDY)[0].token_ids for p in CODE_PROMPTS}


def test_event_order_of_one_request_of_three_tokens():
    """One request, three tokens: launch 1, handle 1, launch 2, handle 2, launch 3, handle 3, and each
    step's events in the order schedule, launch, wait, process, reply."""
    llm = LLM(model="tiny", **NORMAL)
    llm.generate(["def f(x):"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.trace.order() == ["launch 1", "handle 1", "launch 2", "handle 2", "launch 3", "handle 3"]
    assert [(e.kind, e.step) for e in llm.trace] == [
        (kind, step) for step in (1, 2, 3) for kind in ("schedule", "launch", "wait", "process", "reply")]
    assert all(a.t_ns <= b.t_ns for a, b in zip(llm.trace, llm.trace[1:]))
    llm.check_integrity()


def test_admission_queues_requests_when_slots_run_out(solo):
    """Five requests, two request slots: all finish with their solo tokens, never more than two at once,
    and a waiting request joins while another is still decoding (continuous batching)."""
    small = LLM(model="tiny", page_size=4, max_running=2, **NORMAL)
    params = [SamplingParams(max_tokens=4)] + [GREEDY] * 4          # request 0 finishes first
    outs = small.generate(CODE_PROMPTS, params)
    assert [o.token_ids for o in outs] == [solo[CODE_PROMPTS[0]][:4]] + [solo[p] for p in CODE_PROMPTS[1:]]
    steps = [e.uids for e in small.trace if e.kind == "schedule"]
    assert max(len(uids) for uids in steps) <= 2
    joined = steps.index((2,))                                        # request 2's prefill
    assert 1 in steps[joined - 1] and 1 in steps[joined + 1], "request 2 joins while request 1 decodes"
    small.check_integrity()


def test_admission_queues_requests_when_pages_run_out(solo):
    """With 11 free pages, five requests all finish with their solo tokens, and at no step do the requests
    holding pages need more than the 11 (a request needs pages for prompt + max_tokens - 1 tokens); the
    bound is reached, so one more page of admission would break it."""
    small = LLM(model="tiny", page_size=4, num_pages=12, **NORMAL)
    outs = small.generate(CODE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [solo[p] for p in CODE_PROMPTS]
    need = {o.uid: -(-(len(o.prompt_token_ids) + GREEDY.max_tokens - 1) // 4) for o in outs}   # 5, 6, 4, 5, 6
    steps = [(e.step, e.uids) for e in small.trace if e.kind == "schedule"]
    span = {uid: (min(s for s, u in steps if uid in u), max(s for s, u in steps if uid in u)) for uid in need}
    held = [sum(n for uid, n in need.items() if span[uid][0] <= step <= span[uid][1]) for step, _ in steps]
    assert max(held) == 11, f"pages needed by the requests holding pages, per step: {held}"
    small.check_integrity()


def test_a_request_larger_than_the_whole_pool_is_refused():
    """A request that could never fit is refused at once, naming what it needs and what there is."""
    small = LLM(model="tiny", page_size=4, num_pages=4, **NORMAL)
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 26 tokens need 7 pages; the pool has 3"):
        small.generate([[1] * 10], SamplingParams(max_tokens=16))
    small.check_integrity()


def test_stop_rules_and_finish_reasons(tmp_path):
    """EOS stops with 'stop' unless ignore_eos; a stop token stops with 'stop'; max_tokens and the
    context limit stop with 'length'."""
    path = random_checkpoint(tmp_path / "m")
    first, second = LLM(model=str(path), **NORMAL).generate([[7, 8, 9]], SamplingParams(max_tokens=2))[0].token_ids
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": first}))
    llm = LLM(model=str(path), max_seq_len=8, **NORMAL)
    runs = {
        "eos": SamplingParams(max_tokens=4),
        "ignore_eos": SamplingParams(max_tokens=4, ignore_eos=True),
        "stop token": SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(second,)),
        "context": SamplingParams(max_tokens=50, ignore_eos=True),
    }
    outs = {name: llm.generate([[7, 8, 9]], p)[0] for name, p in runs.items()}
    assert (outs["eos"].token_ids, outs["eos"].finish_reason) == ([first], "stop")
    assert (len(outs["ignore_eos"].token_ids), outs["ignore_eos"].finish_reason) == (4, "length")
    assert (outs["stop token"].token_ids, outs["stop token"].finish_reason) == ([first, second], "stop")
    assert (len(outs["context"].token_ids), outs["context"].finish_reason) == (5, "length")   # 3 + 5 = max_seq_len
    llm.check_integrity()


def test_stream_gives_each_client_exactly_its_tokens(llm, solo):
    """Streaming: each request's replies carry its tokens in order, `finished` only on the last reply,
    and nothing after it."""
    received: dict[int, list[int]] = {}
    done: set[int] = set()
    for r in llm.stream(CODE_PROMPTS, GREEDY):
        assert r.uid not in done, f"reply after the last one for request {r.uid}"
        received.setdefault(r.uid, []).extend(r.token_ids)
        if r.finished:
            done.add(r.uid)
    first = min(received)
    assert [received[first + i] for i in range(len(CODE_PROMPTS))] == [solo[p] for p in CODE_PROMPTS]
    assert done == set(received)
    llm.check_integrity()


def test_abort_a_waiting_and_a_running_request(solo):
    """Aborting a running and a waiting request ends each with one 'abort' reply and nothing after;
    the others finish with their solo tokens; every page and slot comes back."""
    llm = LLM(model="tiny", page_size=4, max_running=2, **NORMAL)
    replies = []
    stream = llm.stream(CODE_PROMPTS, GREEDY)
    for r in stream:
        replies.append(r)
        if len(replies) == 3:
            assert [r.uid for r in replies] == [0, 1, 0], "requests 0 and 1 run (prefill, then decode)"
            assert not any(r.finished for r in replies), "request 1 has a token and is not done: it is running"
            llm.abort(1)
            llm.abort(4)                       # request 4 waits: both request slots are taken
    by_uid: dict[int, list] = {}
    for r in replies:
        by_uid.setdefault(r.uid, []).append(r)
    for uid in (1, 4):
        assert by_uid[uid][-1].finish_reason == "abort" and by_uid[uid][-1].finished
        assert sum(r.finished for r in by_uid[uid]) == 1
    assert len(by_uid[4]) == 1, "a waiting request never ran"
    assert not any(4 in e.uids for e in llm.trace if e.kind == "schedule"), "no step ever ran request 4"
    assert [t for r in by_uid[1] for t in r.token_ids] == solo[CODE_PROMPTS[1]][:len(by_uid[1]) - 1]
    for uid in (0, 2, 3):
        assert [t for r in by_uid[uid] for t in r.token_ids] == solo[CODE_PROMPTS[uid]]
    llm.check_integrity()


@pytest.mark.parametrize("prompt, params, message", [
    ("", dict(), "prompt is empty"),
    ([1] * 1024, dict(), "prompt has 1024 tokens; the context holds 1024"),
    ([5, 4096], dict(), r"prompt token id 4096 is outside the vocabulary \[0, 4096\)"),
    ("x", dict(stop_token_ids=(5000,)), r"stop_token_ids holds 5000, outside the vocabulary \[0, 4096\)"),
])
def test_a_bad_request_in_flight_is_refused_and_the_others_finish(llm, solo, prompt, params, message):
    """A bad request added while others run raises ValueError naming the field and the limit; the
    requests in flight finish with their solo tokens and integrity holds."""
    received: dict[int, list[int]] = {}
    for i, r in enumerate(llm.stream(CODE_PROMPTS[:3], GREEDY)):
        received.setdefault(r.uid, []).extend(r.token_ids)
        if i == 4:
            with pytest.raises(ValueError, match=message):
                llm.add_request(prompt, SamplingParams(max_tokens=4, **params))
    first = min(received)
    assert [received[first + i] for i in range(3)] == [solo[p] for p in CODE_PROMPTS[:3]]
    llm.check_integrity()


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be an integer >= 1, got 0"),
    ("temperature", -1.0, "temperature must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", 0, "top_k must be -1"),
])
def test_bad_sampling_params_are_refused_before_they_reach_the_engine(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_check_integrity_catches_a_lost_page_and_a_double_owner(llm):
    """check_integrity is not a formality: a page taken off the free list, or listed twice, is reported."""
    llm.generate(["x = 1"], SamplingParams(max_tokens=2))
    lost = llm.runner.allocator.free_pages.pop()
    with pytest.raises(IntegrityError, match=f"page {lost} is lost"):
        llm.check_integrity()
    llm.runner.allocator.free_pages += [lost, lost]
    with pytest.raises(IntegrityError, match=f"page {lost} is owned or free 2 times"):
        llm.check_integrity()
    llm.runner.allocator.free_pages.pop()
    llm.check_integrity()


@pytest.mark.process
def test_the_command_line_streams_and_traces():
    """`minioverlap generate` prints the completion; `minioverlap trace` prints the normal loop's order."""
    gen = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", "--max-tokens", "5"],
                         capture_output=True, text=True, check=True)
    assert gen.stdout.startswith("def f(x):") and "(5 tokens, finish_reason=length)" in gen.stdout
    trace = subprocess.run([sys.executable, "-m", "minioverlap", "trace"], capture_output=True, text=True, check=True)
    assert "normal:  launch 1, handle 1, launch 2, handle 2, launch 3, handle 3" in trace.stdout


# ---- admission at the exact edge of the page pool; a stop token that is also the last allowed token

def test_admission_admits_a_request_that_needs_exactly_the_free_pages():
    """Pages of 4 tokens, num_pages=4 (page 0 reserved: 3 free). A 5-token prompt with max_tokens=8 needs
    5 + 8 - 1 = 12 tokens = 3 pages, exactly the free pages: it runs and finishes. Two such requests
    with num_pages=7 (6 free) run side by side from the first step."""
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with no_hang(60):
        out = LLM(model="tiny", page_size=4, num_pages=4, **NORMAL).generate([prompt], params)[0]
        assert (len(out.token_ids), out.finish_reason) == (8, "length")
        pair = LLM(model="tiny", page_size=4, num_pages=7, **NORMAL)
        outs = pair.generate([prompt, prompt[::-1]], params)
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(8, "length")] * 2
    assert [e.uids for e in pair.trace if e.kind == "schedule"][0] == (0, 1), "both admitted at step 1"
    pair.check_integrity()


def test_admission_never_admits_a_request_one_page_short():
    """One page too many: with 3 free pages, max_tokens=9 makes 5 + 9 - 1 = 13 tokens = 4 pages, which the
    pool can never hold: ValueError. With 6 free pages, a 3-page request running and a 4-page one waiting
    (3 + 4 = 7 > 6), the second starts only after the first has finished, and both complete."""
    prompt = [11, 12, 13, 14, 15]
    small = LLM(model="tiny", page_size=4, num_pages=4, **NORMAL)
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 14 tokens need 4 pages; the pool has 3"):
        small.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))
    small.check_integrity()
    llm = LLM(model="tiny", page_size=4, num_pages=7, **NORMAL)
    with no_hang(60):
        outs = llm.generate([prompt, prompt[::-1]], [SamplingParams(max_tokens=8, ignore_eos=True),
                                                      SamplingParams(max_tokens=9, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [8, 9]
    steps = [(e.step, e.uids) for e in llm.trace if e.kind == "schedule"]
    last_of_first = max(step for step, uids in steps if 0 in uids)
    first_of_second = min(step for step, uids in steps if 1 in uids)
    assert first_of_second > last_of_first, f"request 1 waits for request 0's pages: {steps}"
    llm.check_integrity()


def test_a_stop_token_that_is_also_the_max_tokens_th_token_finishes_with_stop():
    """When the n-th token is a stop token and max_tokens is n, both rules fire at once: finish_reason is
    'stop' (the stop token ended it), with exactly the n greedy tokens."""
    llm = LLM(model="tiny", **NORMAL)
    prompt = llm.encode("def fibonacci(n):")
    greedy = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    n = next(i + 1 for i in range(3, 16) if greedy[i] not in greedy[:i])   # a token new at its position, from the 4th on
    out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=(greedy[n - 1],)))[0]
    assert (out.token_ids, out.finish_reason) == (greedy[:n], "stop")
    llm.check_integrity()


@pytest.mark.process
def test_the_example_prints_the_normal_loops_order_and_the_five_phases():
    """`python examples/ch04_normal_loop.py` prints the normal loop's order for one request of three
    tokens (in every later stage too, where the overlap loop is the default), then 32 steps of 16
    requests and a mean host time for each of the five phases."""
    out = run_example("examples/ch04_normal_loop.py")
    lines = out.splitlines()
    assert "  launch 1, handle 1, launch 2, handle 2, launch 3, handle 3" in lines
    assert "16 requests, 32 tokens each: 32 steps; mean host time per phase:" in lines
    phases = {line.split()[0] for line in lines[lines.index("16 requests, 32 tokens each: 32 steps; mean host time per phase:") + 1:]}
    assert phases == {"schedule", "launch", "wait", "process", "reply"}
