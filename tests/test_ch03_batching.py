"""Chapter 03: many requests in one batch, each exactly as if it ran alone, each sampled its own way."""

from __future__ import annotations

import pytest
import torch

from conftest import CODE_PROMPTS
from minioverlap import LLM, SamplingParams
from minioverlap.engine.batch_generate import generate_batch
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample_one

MIXED = CODE_PROMPTS + ["a", "def " * 30]          # 1 to 31 tokens


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", page_size=4)


def test_batch_equals_each_prompt_alone(llm):
    """N prompts of mixed lengths served together give, each, the tokens it gets alone."""
    params = SamplingParams(max_tokens=20)
    together = llm.generate(MIXED, params)
    for prompt, out in zip(MIXED, together):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids, repr(prompt)


def test_seeded_request_draws_the_same_tokens_whatever_its_batch(llm):
    """A seeded request samples the same tokens alone and amid other sampled and greedy requests."""
    mine = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    alone = llm.generate(["def parse(line):"], mine)[0].token_ids
    prompts = ["import re\n", "def parse(line):", "class Node:", "x = 2"]
    params = [SamplingParams(max_tokens=24, temperature=1.2, seed=7), mine, SamplingParams(max_tokens=24),
              SamplingParams(max_tokens=9, temperature=0.7)]
    assert llm.generate(prompts, params)[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=99)
    assert llm.generate(["def parse(line):"], other_seed)[0].token_ids != alone, "another seed draws other tokens"


def test_top_k_one_is_greedy(llm):
    """Sampling with top_k=1 can only pick the most likely token: it equals greedy."""
    greedy = llm.generate(MIXED[:3], SamplingParams(max_tokens=16))
    sampled = llm.generate(MIXED[:3], SamplingParams(max_tokens=16, temperature=1.5, top_k=1))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    """With probabilities .5 .3 .15 .05 and top_p=0.7 only the first two can be drawn; top_k=3 drops the last."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    def draws(**kw) -> set[int]:
        req = Req(0, [1], SamplingParams(temperature=1.0, seed=0, **kw), 1)
        req.generator = torch.Generator().manual_seed(0)
        return {int(sample_one(logits, req)) for _ in range(400)}
    assert draws(top_p=0.7) == {0, 1}
    assert draws(top_k=3) == {0, 1, 2}
    assert draws() == {0, 1, 2, 3}
    assert draws(top_p=0.4) == {0}


def test_finished_requests_leave_the_batch(llm):
    """The batch is rebuilt every step: a request that is done stops being computed at once."""
    sizes = []
    forward = llm.runner.forward
    llm.runner.forward = lambda batch: sizes.append((batch.mode, len(batch.reqs))) or forward(batch)
    reqs = [llm.make_request([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True)) for n in (2, 4, 6)]
    try:
        generate_batch(llm.runner, reqs)
    finally:
        llm.runner.forward = forward
    assert sizes == [(ForwardMode.EXTEND, 3), (ForwardMode.DECODE, 3), (ForwardMode.DECODE, 2), (ForwardMode.DECODE, 2),
                     (ForwardMode.DECODE, 1), (ForwardMode.DECODE, 1)]
    assert [len(r.output_ids) for r in reqs] == [2, 4, 6]
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_pages - 1, "every page came back"


def test_the_step_reads_its_inputs_from_token_pool(llm):
    """A decode step's input is what token_pool holds at the request's newest position, on the device."""
    req = llm.make_request([11, 12, 13], SamplingParams(max_tokens=4))
    llm.runner.admit(req)
    try:
        llm.runner.batch(ForwardMode.EXTEND, [req])
        llm.runner.tables.write_tokens(req.row, req.seq_len, [777])
        batch = llm.runner.batch(ForwardMode.DECODE, [req])
        llm.runner.forward(batch)
        assert batch.input_ids.tolist() == [777] and batch.positions.tolist() == [3]
    finally:
        llm.runner.release(req)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), r"temperature must be >= 0 \(0 is greedy\), got -0.1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=0), r"top_k must be -1 \(all tokens\) or an integer >= 1, got 0"),
    (dict(top_k=-5), r"top_k must be -1 \(all tokens\) or an integer >= 1, got -5"),
    (dict(seed="x"), r"seed must be an integer or None, got 'x'"),
])
def test_bad_sampling_params_name_the_field_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
