"""Chapter 07: a run belongs to its caller. A caller that leaves a stream early (break, an exception,
close), a Ctrl-C, a second run started while one is consumed, an abort sent before the first reply, a
request added outside a run, a prompt that can never fit: after each, in both loops, the engine holds
nothing (check_integrity), and its next run gives exactly a fresh engine's tokens."""

from __future__ import annotations

import pytest

from minioverlap import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n"]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
OPTIONS = dict(page_size=4, max_running=2)       # two slots for three prompts: one waits


@pytest.fixture(scope="module")
def fresh_tokens() -> list[list[int]]:
    """What a fresh engine gives for PROMPTS (both loops give the same: chapter 07)."""
    return [o.token_ids for o in LLM(model="tiny", **OPTIONS).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module", params=[False, True], ids=["normal", "overlap"])
def llm(request) -> LLM:
    return LLM(model="tiny", overlap=request.param, **OPTIONS)


def assert_as_good_as_new(llm: LLM, fresh_tokens: list[list[int]]) -> None:
    llm.check_integrity()
    assert not llm.scheduler.busy and llm.scheduler.in_flight == [], "nothing queued, running or in flight"
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == fresh_tokens
    llm.check_integrity()


def test_leaving_a_stream_with_break_aborts_its_requests(llm, fresh_tokens):
    """break after two replies: the stream's requests are aborted and freed; none of them runs later."""
    stream = llm.stream(PROMPTS, PARAMS)
    for n, _ in enumerate(stream, start=1):
        if n == 2:
            break
    stream.close()                       # what the garbage collector does to an abandoned stream
    assert_as_good_as_new(llm, fresh_tokens)


def test_an_exception_in_the_consumer_aborts_the_run(llm, fresh_tokens):
    with pytest.raises(ZeroDivisionError):
        for reply in llm.stream(PROMPTS, PARAMS):
            if reply.token_ids:
                1 / 0
    assert_as_good_as_new(llm, fresh_tokens)


def test_closing_a_stream_after_some_replies(llm, fresh_tokens):
    stream = llm.stream(PROMPTS, PARAMS)
    [next(stream) for _ in range(3)]
    stream.close()
    assert_as_good_as_new(llm, fresh_tokens)


def test_ctrl_c_during_generate_then_generate_again(llm, fresh_tokens, monkeypatch):
    """A KeyboardInterrupt in the middle of a run (here: raised by the third launch) reaches the caller;
    the interrupted run's requests are freed and the next generate is a fresh engine's."""
    launch, calls = llm.runner.launch, []

    def interrupted(batch, step):
        calls.append(step)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return launch(batch, step)

    monkeypatch.setattr(llm.runner, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert_as_good_as_new(llm, fresh_tokens)


def test_a_second_run_while_a_stream_is_consumed_is_refused(llm, fresh_tokens):
    """generate or a second stream inside a consumer: a RuntimeError, and the outer stream goes on to
    give every client exactly its tokens."""
    got: dict[int, list[int]] = {}
    for reply in llm.stream(PROMPTS, PARAMS):
        got.setdefault(reply.uid, []).extend(reply.token_ids)
        with pytest.raises(RuntimeError, match="a run is in progress"):
            llm.generate(["x = 1"], PARAMS)
        with pytest.raises(RuntimeError, match="a run is in progress"):
            next(llm.stream(["x = 1"], PARAMS))
    assert list(got.values()) == fresh_tokens
    assert_as_good_as_new(llm, fresh_tokens)


def test_an_abort_sent_before_the_first_reply_is_not_lost(llm, fresh_tokens):
    stream = llm.stream(PROMPTS, PARAMS)
    first = llm.next_uid - len(PROMPTS)
    llm.abort(first + 1)
    replies = list(stream)
    assert [(r.token_ids, r.finish_reason) for r in replies if r.uid == first + 1] == [([], "abort")]
    tokens = {uid: sum((r.token_ids for r in replies if r.uid == uid), []) for uid in (first, first + 2)}
    assert list(tokens.values()) == [fresh_tokens[0], fresh_tokens[2]]
    assert_as_good_as_new(llm, fresh_tokens)


def test_an_abort_sent_before_a_stream_starts_survives_another_run(llm, fresh_tokens):
    """The stream's requests get their uids at once but reach the scheduler only at its first reply. An
    abort sent in between waits with them, even while another run (a generate) empties the inbox."""
    stream = llm.stream(PROMPTS, PARAMS)
    first = llm.next_uid - len(PROMPTS)
    llm.abort(first + 1)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == fresh_tokens
    replies = list(stream)
    assert [(r.token_ids, r.finish_reason) for r in replies if r.uid == first + 1] == [([], "abort")]
    tokens = {uid: sum((r.token_ids for r in replies if r.uid == uid), []) for uid in (first, first + 2)}
    assert list(tokens.values()) == [fresh_tokens[0], fresh_tokens[2]]
    assert_as_good_as_new(llm, fresh_tokens)


def test_add_request_outside_a_run_is_refused_and_changes_nothing(llm, fresh_tokens):
    uid = llm.next_uid
    with pytest.raises(RuntimeError, match="add_request adds to a run in progress"):
        llm.add_request("x = 1", PARAMS)
    assert llm.next_uid == uid
    assert_as_good_as_new(llm, fresh_tokens)


def test_a_prompt_that_can_never_fit_refuses_the_whole_list(fresh_tokens):
    """The pool holds 8 pages of 4 tokens. The second prompt needs 9 pages: ValueError, and the first
    prompt is not queued either (it would run, unasked, in the next call)."""
    for overlap in (False, True):
        llm = LLM(model="tiny", overlap=overlap, page_size=4, num_pages=9)
        uid = llm.next_uid
        with pytest.raises(ValueError, match=r"need 9 pages; the pool has 8"):
            llm.generate(["def f(x):", list(range(1, 30))], SamplingParams(max_tokens=8))
        assert llm.next_uid == uid and not llm.scheduler.busy
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.uid for o in outs] == [uid, uid + 1, uid + 2]
        assert [o.token_ids for o in outs] == fresh_tokens
        llm.check_integrity()


def test_a_failing_step_frees_its_requests(llm, fresh_tokens, monkeypatch):
    """An error the engine did not foresee, raised by a step's forward pass: it reaches the caller, and
    the requests of the run do not stay in `running` to poison the next call."""
    def broken(batch, *inputs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(llm.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="planted failure"):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert_as_good_as_new(llm, fresh_tokens)


def test_a_request_whose_sampling_fails_fails_alone(llm, fresh_tokens, monkeypatch):
    """An error the engine did not foresee in one request's sampling (planted: the request with seed 13
    raises at its third token): that request ends with finish_reason "error", its reply naming the
    error, and nothing after it; the other requests of the same stream get exactly the tokens they get
    without it (seeded, so their draws do not depend on the batch); the engine is as good as new."""
    from minioverlap.engine import sampler

    real = sampler.sample_one

    def planted(logits, req):
        if req.params.seed == 13 and len(req.output_ids) == 2:
            raise RuntimeError("planted failure")
        return real(logits, req)

    monkeypatch.setattr(sampler, "sample_one", planted)
    others = [SamplingParams(max_tokens=8, temperature=0.8, seed=s) for s in (1, 2)]
    alone = [o.token_ids for o in llm.generate(PROMPTS[:2], others)]
    params = [others[0], SamplingParams(max_tokens=8, temperature=0.8, seed=13), others[1]]
    replies = list(llm.stream([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params))
    failed = [r for r in replies if r.finish_reason == "error"]
    assert len(failed) == 1 and failed[0].error == "RuntimeError: planted failure"
    uid = failed[0].uid
    assert sum(len(r.token_ids) for r in replies if r.uid == uid) == 2, "the tokens before the failure, none after"
    assert replies.index(failed[0]) == max(i for i, r in enumerate(replies) if r.uid == uid), "nothing after it"
    got = {}
    for r in replies:
        got.setdefault(r.uid, []).extend(r.token_ids)
    assert [got[uid - 1], got[uid + 1]] == alone
    monkeypatch.undo()
    assert_as_good_as_new(llm, fresh_tokens)
