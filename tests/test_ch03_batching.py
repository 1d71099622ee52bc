"""Chapter 03: many requests in one batch, each exactly as if it ran alone, each sampled its own way."""

from __future__ import annotations

import pytest
import torch

from conftest import CODE_PROMPTS, run_example
from minioverlap import LLM, SamplingParams
from minioverlap.reference.batch_generate import generate_batch
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample, sample_one

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


def kept_by_transformers(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """The tokens transformers' warpers leave drawable: TemperatureLogitsWarper, then TopPLogitsWarper."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits[None].clone()))
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def drawn(logits: torch.Tensor, params: SamplingParams, n: int = 2000) -> set[int]:
    """Every token the sampler draws in n draws of one request (through sample(), as a step calls it)."""
    req = Req(0, [1], params, 1)
    req.generator = torch.Generator().manual_seed(0)
    return set(sample(logits.expand(n, -1).clone(), [req] * n).tolist())


@pytest.mark.parametrize("temperature, kept", [(0.7, {0, 1}), (1.5, {0, 1, 2, 3})])
def test_temperature_is_applied_once_before_top_p(temperature, kept):
    """At T=0.7 and T=1.5 with top_p=0.8 the sampler draws exactly the tokens transformers keeps
    (temperature, then top-p). The sets differ from those of T=1 ({0, 1, 2}), of T applied twice
    (T^2 = 0.49: {0}; 2.25: {0..4}) and of top-p before the temperature (T=1's set): every kept token
    holds >= 10% of the mass, so 2000 draws show each."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    assert kept_by_transformers(logits, temperature, 0.8) == kept
    assert kept_by_transformers(logits, 1.0, 0.8) == {0, 1, 2}, "the temperature changes the set"
    assert drawn(logits, SamplingParams(temperature=temperature, top_p=0.8)) == kept


def test_top_p_at_an_exact_tie_keeps_the_smallest_set_that_reaches_p():
    """Four tokens of equal logits and top_p=.5 keep two, the mass exactly p, as transformers'
    TopPLogitsWarper does. Every probability (.25) and every sum of them is exact in binary, so no
    rounding decides the tie: the rule does. A token is dropped once the tokens ranked above it already
    hold >= p, so the kept set is the smallest whose mass reaches p, p itself included; not three (the
    third has .5 above it: a rule of > p would keep it), not one (.25 is short of p). Which two of the
    equal tokens stay is a tie-break, not the rule, so only their count is checked."""
    logits = torch.zeros(4)
    assert logits.double().softmax(-1).cumsum(-1).tolist() == [0.25, 0.5, 0.75, 1.0], "exact in float64"
    ref = kept_by_transformers(logits, 1.0, 0.5)
    got = drawn(logits, SamplingParams(temperature=1.0, top_p=0.5), n=400)
    assert len(ref) == 2, f"transformers kept {sorted(ref)}"
    assert len(got) == 2, f"kept {sorted(got)}: two of the four equal tokens, whose mass is exactly p"


def test_finished_requests_leave_the_batch(llm):
    """The batch is rebuilt every step: a request that is done stops being computed at once."""
    sizes = []
    forward = llm.runner.forward
    llm.runner.forward = lambda batch, *inputs: sizes.append((batch.mode, len(batch.reqs))) or forward(batch, *inputs)
    reqs = [llm.make_request([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True)) for n in (2, 4, 6)]
    try:
        generate_batch(llm.runner, reqs)
    finally:
        llm.runner.forward = forward
    assert sizes == [(ForwardMode.EXTEND, 3), (ForwardMode.DECODE, 3), (ForwardMode.DECODE, 2), (ForwardMode.DECODE, 2),
                     (ForwardMode.DECODE, 1), (ForwardMode.DECODE, 1)]
    assert [len(r.output_ids) for r in reqs] == [2, 4, 6]
    kept = llm.runner.cache.tree.cached_pages if getattr(llm.runner.cache, "tree", None) else 0   # from chapter 17: earlier runs' prefixes
    assert llm.runner.allocator.num_free + kept == llm.runner.allocator.num_pages - 1, "every page came back"


def test_the_step_reads_its_inputs_from_token_pool(llm):
    """A decode step's input is what token_pool holds at the request's newest position, on the device."""
    req = llm.make_request([11, 12, 13], SamplingParams(max_tokens=4))
    llm.runner.admit(req)
    try:
        llm.runner.batch(ForwardMode.EXTEND, [req])
        llm.runner.tables.write_tokens(req.row, req.seq_len, [777])
        req.output_ids.append(777)             # the host's copy, as if 777 had been sampled
        batch = llm.runner.batch(ForwardMode.DECODE, [req])
        assert llm.runner.read_inputs(batch).tolist() == [777] and batch.positions.tolist() == [3]
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


@pytest.mark.process
def test_the_example_shows_each_prompt_equal_to_its_solo_run_and_the_seed_kept():
    """`python examples/ch03_batching.py`: five prompts in one batch, each equal to its solo run, and a
    seeded sample that draws the same tokens alone and in a batch."""
    out = run_example("examples/ch03_batching.py")
    assert out.count("-> equal to its solo run: True") == 5 and "False" not in out
    assert "5 prompts: " in out and "same tokens: True" in out


@pytest.mark.process
def test_the_command_line_samples_with_the_options_it_is_given():
    """`minioverlap generate --temperature --top-k --top-p --seed --max-tokens` streams the tokens that
    LLM.generate samples with the same SamplingParams; a bad option is refused by name, with no traceback."""
    import subprocess
    import sys

    options = dict(max_tokens=12, temperature=0.8, top_k=50, top_p=0.95, seed=7)
    args = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    run = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = LLM(model="tiny", device="cpu").generate(["def f(x):"], SamplingParams(**options))[0]   # where the CLI runs
    assert "".join(run.stdout.split()).startswith("".join(("def f(x):" + out.text).split()))   # wrapping aside
    assert f"({len(out.token_ids)} tokens, finish_reason={out.finish_reason})" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "x", "--top-k", "0"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_k must be -1 (all tokens) or an integer >= 1, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr
