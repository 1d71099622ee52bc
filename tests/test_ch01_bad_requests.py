"""Chapter 01: a bad prompt, bad params or a bad max_tokens / ignore_eos is refused with a ValueError that
names the field and the value, and changes nothing: the engine then gives a fresh engine's tokens.
NumPy integers count as integers wherever an int does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import GREEDY, PROBE, assert_as_fresh, probe_tokens
from minioverlap import LLM, SamplingParams



@pytest.fixture(scope="module")
def engine() -> tuple[LLM, list[list[int]]]:
    """One engine for the module, and its greedy tokens while it is fresh."""
    llm = LLM(model="tiny")
    return llm, probe_tokens(llm)



@pytest.mark.parametrize("prompts, params, message", [
    ([None], GREEDY, r"prompt token id None is not an integer"),
    ([1.0, 2.0], GREEDY, r"prompt token id 1\.0 is not an integer"),
    ([[1, np.float64(2.0)]], GREEDY, r"prompt token id np\.float64\(2\.0\) is not an integer"),
    ([[1, True]], GREEDY, r"prompt token id True is not an integer"),
    ([[1, 2], None], GREEDY, r"prompt must be text or a list of token ids, got None"),
    (5, GREEDY, r"prompts must be a prompt or a non-empty list of prompts, got 5"),
    ([[1, 2]], {"max_tokens": 3}, r"params must be a SamplingParams or a list of one per prompt, got \{'max_tokens': 3\}"),
    ([[1, 2]], "greedy", r"params must be a SamplingParams or a list of one per prompt, got 'greedy'"),
    ([[1, 2]], [None], r"params must be a SamplingParams or a list of one per prompt, got \[None\]"),
    ([[1, 2], [3]], [GREEDY, None], r"params must be a SamplingParams or a list of one per prompt"),
])
def test_a_bad_prompt_or_params_is_refused_naming_the_field(engine, prompts, params, message):
    llm, fresh = engine
    uid = llm.next_uid
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert llm.next_uid == uid, "no request was numbered"
    assert_as_fresh(llm, fresh)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=True), r"max_tokens must be an integer >= 1, got True"),
    (dict(max_tokens=None), r"max_tokens must be an integer >= 1, got None"),
    (dict(max_tokens="4"), r"max_tokens must be an integer >= 1, got '4'"),
    (dict(max_tokens=np.float64(4.0)), r"max_tokens must be an integer >= 1, got np\.float64\(4\.0\)"),
    (dict(max_tokens=np.int64(0)), r"max_tokens must be an integer >= 1, got np\.int64\(0\)"),
    (dict(ignore_eos="no"), r"ignore_eos must be True or False, got 'no'"),
    (dict(ignore_eos=None), r"ignore_eos must be True or False, got None"),
    (dict(ignore_eos=2), r"ignore_eos must be True or False, got 2"),
])
def test_bad_max_tokens_or_ignore_eos_is_refused_naming_field_and_value(engine, kwargs, message):
    llm, fresh = engine
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert_as_fresh(llm, fresh)


def test_numpy_integers_are_token_ids_and_counts(engine):
    """NumPy token ids and a NumPy max_tokens give the tokens plain ints give (they were once refused as
    'outside the vocabulary'); the params keep a plain int."""
    llm, fresh = engine
    params = SamplingParams(max_tokens=np.int64(4))
    assert type(params.max_tokens) is int and params == GREEDY
    assert llm.generate([np.array(PROBE[0])[i] for i in range(3)], params)[0].token_ids == fresh[0]
    assert llm.generate([list(np.array(PROBE[0], dtype=np.int32))], params)[0].token_ids == fresh[0]
    assert_as_fresh(llm, fresh)


def test_sampling_params_are_frozen_once_checked():
    """No assignment can slip past the checks: fields cannot be set, and replace() checks again."""
    params = SamplingParams(max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        dataclasses.replace(params, max_tokens=0)
    assert params.max_tokens == 4
