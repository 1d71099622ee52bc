"""Chapter 03: bad sampling parameters are refused naming field, value and limit; extreme valid ones
sample as transformers' own warpers do, where the old arithmetic crashed (temperature=1e-45 overflowed,
top_p=1e-300 rounded to 0 in float32 and dropped every token)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from conftest import PROBE, assert_as_fresh, probe_tokens
from minioverlap import LLM, SamplingParams
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample_one

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def engine() -> tuple[LLM, list[list[int]]]:
    """One engine for the module, and its greedy tokens while it is fresh."""
    llm = LLM(model="tiny", page_size=4)
    return llm, probe_tokens(llm)



@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=True), r"top_k must be -1 \(all tokens\) or an integer >= 1, got True"),
    (dict(top_k=5.0), r"top_k must be -1 \(all tokens\) or an integer >= 1, got 5\.0"),
    (dict(temperature="0.7"), r"temperature must be a finite number, got '0\.7'"),
    (dict(temperature=None), r"temperature must be a finite number, got None"),
    (dict(temperature=NAN), r"temperature must be a finite number, got nan"),
    (dict(temperature=INF), r"temperature must be a finite number, got inf"),
    (dict(temperature=True), r"temperature must be a finite number, got True"),
    (dict(temperature=5e-324), r"temperature must be 0 \(greedy\) or >= 2\.2250738585072014e-308, got 5e-324"),
    (dict(top_p="0.9"), r"top_p must be in \(0, 1\], got '0\.9'"),
    (dict(top_p=None), r"top_p must be in \(0, 1\], got None"),
    (dict(top_p=NAN), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_p=INF), r"top_p must be in \(0, 1\], got inf"),
    (dict(seed=1.5), r"seed must be an integer or None, got 1\.5"),
    (dict(seed=True), r"seed must be an integer or None, got True"),
    (dict(seed=2**64), r"seed must be in \[-2\*\*63, 2\*\*64 - 1\] .*got 18446744073709551616"),
    (dict(seed=-2**70), r"seed must be in \[-2\*\*63, 2\*\*64 - 1\] .*got -1180591620717411303424"),
])
def test_bad_sampling_params_are_refused_naming_field_value_and_limit(engine, kwargs, message):
    """Refused when made, before any request exists (a seed torch rejects once failed after admission
    and kept its request slot forever)."""
    llm, fresh = engine
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert_as_fresh(llm, fresh)


def test_numpy_numbers_are_accepted_and_kept_as_python_numbers(engine):
    """NumPy integers and floats give the params, and the tokens, that plain numbers give."""
    llm, fresh = engine
    plain = SamplingParams(max_tokens=8, temperature=0.75, top_k=20, top_p=0.5, seed=2**64 - 1)
    numpy = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.75), top_k=np.int32(20),
                           top_p=np.float64(0.5), seed=np.uint64(2**64 - 1))
    assert numpy == plain and type(numpy.top_k) is int and type(numpy.temperature) is float
    assert llm.generate(PROBE, numpy)[1].token_ids == llm.generate(PROBE, plain)[1].token_ids
    assert_as_fresh(llm, fresh)


def distribution(logits: torch.Tensor, **params) -> torch.Tensor:
    """The distribution sample_one draws from: the weights it hands torch.multinomial, normalised as
    multinomial does. Also checks that the token drawn has weight > 0."""
    req = Req(0, [1], SamplingParams(seed=0, **params), 1)
    req.generator = torch.Generator().manual_seed(0)
    with mock.patch("torch.multinomial", wraps=torch.multinomial) as draw:
        token = sample_one(logits, req)
    weights = draw.call_args.args[0]
    assert weights[token] > 0
    return weights / weights.sum()


def transformers_distribution(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0):
    """transformers' warpers in generate's order (temperature, top-k, top-p), then the softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits[None])
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=40),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, top_k=100, top_p=0.5),
    dict(temperature=1.0, top_p=1e-300),              # keeps the top token, as transformers does
    dict(temperature=2.0, top_k=1),
])
def test_the_sampler_draws_from_the_distribution_of_transformers_warpers(params):
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 3
    torch.testing.assert_close(distribution(logits, **params).float(), transformers_distribution(logits, **params),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("params", [dict(temperature=1e-45), dict(temperature=1e-300, top_k=3),
                                    dict(temperature=2.3e-308, top_p=1e-300)])
def test_a_temperature_too_small_to_divide_by_is_greedy(params):
    """Dividing by 1e-45 overflows float32 (transformers' warper gives inf logits and a NaN softmax);
    the sampler takes the limit of sampling as the temperature goes to 0: all mass on the argmax."""
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 3
    assert not transformers_distribution(logits, 1e-45).isfinite().all(), "transformers cannot divide by it"
    expected = torch.zeros(4096, dtype=torch.float64)
    expected[logits.argmax()] = 1.0
    assert torch.equal(distribution(logits, **params), expected)


@pytest.mark.parametrize("params", [dict(temperature=1e-45), dict(temperature=1.0, top_p=1e-300),
                                    dict(temperature=2.3e-308, top_p=5e-324)])
def test_extreme_valid_params_generate_the_greedy_tokens(engine, params):
    """Valid parameters that once crashed the step: each leaves only the argmax, so they are greedy."""
    llm, fresh = engine
    assert [o.token_ids for o in llm.generate(PROBE, SamplingParams(max_tokens=4, seed=1, **params))] == fresh
    assert_as_fresh(llm, fresh)
