"""Chapter 04: stop tokens and abort. Bad stop_token_ids, a bad uid to abort, or bad params added to a run
in progress are refused with a ValueError naming the field; requests in flight finish as if nothing had
happened, and the engine then gives a fresh engine's tokens with every page and slot accounted for."""

from __future__ import annotations

import re

import numpy as np
import pytest

import minioverlap
from conftest import GREEDY, PROBE, assert_as_fresh, probe_tokens
from minioverlap import LLM, SamplingParams
from minioverlap.scheduler.checks import IntegrityError

STREAMED = ["def fibonacci(n):", "class Stack:"]


@pytest.fixture(scope="module")
def engine() -> tuple[LLM, list[list[int]]]:
    """One engine for the module, and its greedy tokens while it is fresh."""
    llm = LLM(model="tiny", page_size=4)
    return llm, probe_tokens(llm)


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """The greedy tokens of each STREAMED prompt served without interruption."""
    return [o.token_ids for o in engine[0].generate(STREAMED, GREEDY)]



@pytest.mark.parametrize("stop_token_ids, message", [
    (None, r"stop_token_ids must be a list or tuple of token ids, got None"),
    (5, r"stop_token_ids must be a list or tuple of token ids, got 5"),
    ("5", r"stop_token_ids must be a list or tuple of token ids, got '5'"),
    ([5, 1.0], r"stop_token_ids\[1\] must be an integer token id, got 1\.0"),
    ([None], r"stop_token_ids\[0\] must be an integer token id, got None"),
    ([True], r"stop_token_ids\[0\] must be an integer token id, got True"),
])
def test_bad_stop_token_ids_are_refused_naming_the_field(engine, stop_token_ids, message):
    llm, fresh = engine
    with pytest.raises(ValueError, match=message):
        SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids)
    assert_as_fresh(llm, fresh)


def test_numpy_stop_token_ids_stop_like_ints(engine):
    """A NumPy stop id is a token id (it was once refused as 'outside the vocabulary') and stops the
    request where the same int does; one outside the vocabulary is still refused as such."""
    llm, fresh = engine
    second = fresh[0][1]
    plain = llm.generate(PROBE[:1], SamplingParams(max_tokens=4, stop_token_ids=[second]))[0]
    numpy = llm.generate(PROBE[:1], SamplingParams(max_tokens=4, stop_token_ids=[np.int64(second)]))[0]
    assert (numpy.token_ids, numpy.finish_reason) == (plain.token_ids, plain.finish_reason) == (fresh[0][:2], "stop")
    with pytest.raises(ValueError, match=r"stop_token_ids holds 4096, outside the vocabulary \[0, 4096\)"):
        llm.generate(PROBE, SamplingParams(max_tokens=4, stop_token_ids=[np.int64(4096)]))
    assert_as_fresh(llm, fresh)


@pytest.mark.parametrize("uid", ["x", None, 1.5, True, [0]])
def test_abort_of_a_non_integer_uid_is_refused_while_the_run_goes_on(engine, alone, uid):
    """abort(uid) needs a request's id; a bad one raises in the middle of a stream and the requests in
    flight finish with the tokens they get alone."""
    llm, fresh = engine
    message = "uid must be an integer, a request's id, got " + re.escape(repr(uid))
    received: dict[int, list[int]] = {}
    for i, r in enumerate(llm.stream(STREAMED, GREEDY)):
        received.setdefault(r.uid, []).extend(r.token_ids)
        if i == 1:
            with pytest.raises(ValueError, match=message):
                llm.abort(uid)
    assert [received[u] for u in sorted(received)] == alone
    assert_as_fresh(llm, fresh)


def test_abort_of_a_uid_no_request_has_is_refused_and_aborts_nothing_later():
    """abort(uid) names a request that exists when it is sent. A uid not given out yet is refused (it
    once aborted the next request to get that uid); a finished request's abort changes nothing."""
    llm = LLM(model="tiny", page_size=4)
    with pytest.raises(ValueError, match=r"uid 0 names no request: the requests made so far are none"):
        llm.abort(0)
    fresh = probe_tokens(llm)                   # uids 0 and 1
    for uid in (2, 7, -1):
        with pytest.raises(ValueError, match=rf"uid {uid} names no request: the requests made so far have uids 0 to 1"):
            llm.abort(uid)
    llm.abort(1)                                # finished: nothing to stop
    outs = llm.generate(PROBE, GREEDY)          # uids 2 and 3: neither is aborted
    assert [(o.uid, o.token_ids, o.finish_reason) for o in outs] == [(2, fresh[0], "length"), (3, fresh[1], "length")]
    assert_as_fresh(llm, fresh)


def test_abort_takes_a_numpy_uid(engine):
    """A uid that arrives as a NumPy integer (from an array of uids) aborts its request."""
    llm, fresh = engine
    aborted, finish = None, {}
    for r in llm.stream(STREAMED, SamplingParams(max_tokens=8, ignore_eos=True)):
        if aborted is None:
            aborted = r.uid
            llm.abort(np.int64(aborted))
        if r.finished:
            finish[r.uid] = r.finish_reason
    assert finish.pop(aborted) == "abort" and list(finish.values()) == ["length"]
    assert_as_fresh(llm, fresh)


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 4}, r"params must be a SamplingParams or a list of one per prompt, got \{'max_tokens': 4\}"),
    ("greedy", r"params must be a SamplingParams or a list of one per prompt, got 'greedy'"),
    ([None], r"params must be a SamplingParams or a list of one per prompt, got \[None\]"),
])
def test_bad_params_added_in_flight_are_refused_and_the_others_finish(engine, alone, params, message):
    llm, fresh = engine
    received: dict[int, list[int]] = {}
    for i, r in enumerate(llm.stream(STREAMED, GREEDY)):
        received.setdefault(r.uid, []).extend(r.token_ids)
        if i == 1:
            uid = llm.next_uid
            with pytest.raises(ValueError, match=message):
                llm.add_request([5, 6], params)
            assert llm.next_uid == uid, "the refused request took no uid"
    assert [received[u] for u in sorted(received)] == alone
    assert_as_fresh(llm, fresh)


def test_the_errors_a_caller_may_catch_are_importable_from_the_package():
    assert minioverlap.IntegrityError is IntegrityError
    assert minioverlap.CheckpointError is minioverlap.model.loader.CheckpointError
    # >>> ch08: the hazard checker's error
    from minioverlap.device.hazard import HazardError
    assert minioverlap.HazardError is HazardError
    # <<< ch08
