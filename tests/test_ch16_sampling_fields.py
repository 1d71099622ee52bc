"""Chapter 16: the sampling fields vLLM's and SGLang's OpenAI servers take besides OpenAI's own: min_p,
repetition_penalty, min_tokens and skip_special_tokens.

Each against a recomputation: greedy repetition_penalty and min_tokens against transformers' generate
with its own logits processors (RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor) on
the same checkpoint, a prompt the prefix cache served included; min_p against transformers'
MinPLogitsWarper and a plain recomputation, and every token an engine samples with it against the
model's distribution at its position; min_tokens with stop strings and skip_special_tokens against the
tokenizer's own text. In both loops, with and without MTP (k=3), where the host's count of a request's
tokens lags the device's; equal tokens in both loops (greedy and seeded), MTP greedy lossless; the
hazard checker silent; bad values refused, naming the field."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from conftest import CODE_PROMPTS, TINY, _hf_model
from minioverlap import LLM, SamplingParams
from minioverlap.config import EngineArgs
from minioverlap.engine.sampler import adjusted_probs
from test_ch16_logprobs_stop import LOOPS, SEQ_LEN, engines  # noqa: F401  (engines: the module's engine per setting)

EOS_FIRST = "if __name__ == '__main__':\n    main()\n"   # the tiny model's greedy answer: EOS at once
LINES = "import os\n"                # greedy: "import sys\nimport unittest\n...", a "\n" (token 199) third
NEWLINE = 199
pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one torch thread for the module


@functools.lru_cache(maxsize=None)
def hf_generate(prompt: tuple[int, ...], max_tokens: int, stops: tuple[int, ...] = (0,), **processors) -> list[int]:
    """transformers' greedy generate on the tiny checkpoint (fp32, CPU), ending at any of `stops` (EOS is
    token 0), with its own logits processors: repetition_penalty, min_new_tokens."""
    out = _hf_model(str(TINY)).generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=list(stops), pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **processors)
    return out[0, len(prompt):].tolist()


def model_probs(prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) of transformers at each output position [len(output), vocab]."""
    with torch.no_grad():
        logits = _hf_model(str(TINY))(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].double()
    return (logits / temperature).softmax(dim=-1)


def ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.processor.encode(p) for p in prompts]


# ---- repetition_penalty


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_repetition_penalty_equals_transformers(engines, overlap, mtp):
    """Greedy with a penalty (> 1 and < 1) gives transformers' tokens with its RepetitionPenaltyLogitsProcessor,
    which counts the prompt and every token generated: in the overlap loop the device chooses a token before
    the host has received the one before it, and with MTP a verify's row j after the drafts before it."""
    llm = engines(overlap, mtp)
    prompts = ids(llm, CODE_PROMPTS)
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32))]
    for penalty in (1.3, 0.7):
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, repetition_penalty=penalty))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_generate(tuple(prompt), 32, repetition_penalty=penalty), (penalty, prompt)
        assert [o.token_ids for o in outs] != plain          # the penalty changed something
    llm.check_integrity()


# ---- min_tokens


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_min_tokens_equals_transformers(engines, overlap, mtp):
    """EOS and stop_token_ids cannot end a request before min_tokens tokens, as transformers'
    MinNewTokensLengthLogitsProcessor rules: the first min_tokens tokens are none of them. Greedy "import
    os\\n" takes its first stop (a newline) as its third token: min_tokens 2 leaves it there, 3 forbids it
    at exactly that token, the one a count one step late (the host's, in the overlap loop) gets wrong."""
    llm = engines(overlap, mtp)
    eos_first, lines = ids(llm, [EOS_FIRST, LINES])
    cases = [(eos_first, (), 1), (eos_first, (), 5), (lines, (NEWLINE,), 2), (lines, (NEWLINE,), 3),
             (lines, (NEWLINE,), 7)]
    params = [SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=stops) for _, stops, m in cases]
    outs = llm.generate([p for p, _, _ in cases], params)
    for (prompt, stops, m), out in zip(cases, outs):
        assert out.token_ids == hf_generate(tuple(prompt), 24, (0, *stops), min_new_tokens=m), (stops, m)
        assert not {0, *stops} & set(out.token_ids[:m])
    assert len(outs[2].token_ids) == 3 < len(outs[3].token_ids)        # the newline where it was, then held back
    assert outs[0].token_ids[-1] == 0 and outs[0].finish_reason == "stop"
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_min_tokens_holds_back_stop_strings(engines, overlap, mtp):
    """A stop string counts only if it ends in the text of the min_tokens-th token or a later one (vLLM
    checks none before): one earlier stays in the text, and the request ends at the next, cut before it."""
    llm = engines(overlap, mtp)
    prompt = CODE_PROMPTS[4]                                   # greedy: 'x)\nprint(x)\nprint(x)\n...'
    tokens = llm.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids
    decode = llm.processor.decode
    for m in (1, 4, 6):
        start = max(len(decode(tokens[:m - 1])) - len("print") + 1, 0)   # one ending in the first m-1 tokens' text is early
        end = next(j for j in range(m - 1, len(tokens)) if decode(tokens[:j + 1]).find("print", start) >= 0)
        out = llm.generate([prompt], SamplingParams(max_tokens=24, stop="print", min_tokens=m))[0]
        assert out.token_ids == tokens[:end + 1] and out.finish_reason == "stop", m
        text = decode(tokens[:end + 1])
        assert out.text == text[:text.find("print", start)]
        assert ("print" in out.text) == (m > 4)           # an early stop string stays in the text
    llm.check_integrity()


# ---- min_p


def reference_min_p(logits: torch.Tensor, temperature: float, min_p: float, top_p: float = 1.0) -> torch.Tensor:
    """vLLM's order, written plainly: the temperature, min_p against the top token, then top-p over what is
    left, renormalised."""
    probs = (logits.double() / temperature).softmax(dim=-1)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    probs = probs / probs.sum()
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in order.tolist():
        if mass >= top_p:
            break
        keep[token], mass = True, mass + probs[token].item()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("temperature, min_p", [(0.7, 0.05), (1.5, 0.3), (1.0, 1.0)])
def test_min_p_equals_transformers_warper(temperature, min_p):
    """adjusted_probs with min_p keeps exactly the tokens transformers' MinPLogitsWarper keeps (after its
    TemperatureLogitsWarper), with the same probabilities; with top_p too, as vLLM orders them (min_p first)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    torch.manual_seed(0)
    with torch.no_grad():
        model = _hf_model(str(TINY))(torch.tensor([[605, 657, 199, 605]])).logits[0, -1].float()
    for logits in (model, 4 * torch.randn(4096)):
        ours = adjusted_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits[None].clone()))
        theirs = warped[0].double().softmax(dim=-1)
        assert torch.equal(ours > 0, theirs > 0)
        torch.testing.assert_close(ours / ours.sum(), theirs, rtol=1e-5, atol=1e-6)   # theirs divided in float32
        with_top_p = adjusted_probs(logits, SamplingParams(temperature=temperature, min_p=min_p, top_p=0.6))
        torch.testing.assert_close(with_top_p / with_top_p.sum(), reference_min_p(logits, temperature, min_p, 0.6))
    greedy = adjusted_probs(model, SamplingParams(temperature=1.0, min_p=1.0))
    assert greedy.nonzero().flatten().tolist() == [model.argmax().item()]


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_min_p_samples_only_the_tokens_it_keeps(engines, overlap, mtp):
    """Every token sampled with min_p has a probability of at least min_p times the top token's at its
    position, under the model's distribution recomputed by transformers (with MTP, through the accept
    rule's distribution). The same check fails without min_p, so it has the power to fail."""
    llm = engines(overlap, mtp)
    prompts = ids(llm, CODE_PROMPTS)

    def worst(min_p: float) -> float:
        """The smallest p(token) / p(top) over every sampled token."""
        params = [SamplingParams(max_tokens=24, temperature=1.5, min_p=min_p, seed=i) for i in range(len(prompts))]
        ratios = []
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            probs = model_probs(prompt, out.token_ids, 1.5)
            ratios += (probs.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0] / probs.max(dim=1).values).tolist()
        return min(ratios)

    assert worst(0.2) >= 0.2 * (1 - 1e-4)
    assert worst(0.0) < 0.2
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_min_p_one_samples_the_argmax(engines, overlap, mtp):
    """min_p = 1 keeps the top token alone: sampling at temperature 1 gives greedy's tokens (with MTP,
    through the sampled accept rule, whose adjusted distribution is then one-hot)."""
    llm = engines(overlap, mtp)
    greedy = [o.token_ids for o in llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=24))]
    sampled = llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, min_p=1.0, seed=3))
    assert [o.token_ids for o in sampled] == greedy


# ---- the loops agree


def mixed_params() -> list[SamplingParams]:
    """A batch that mixes requests with every field, greedy and seeded, and plain ones."""
    return [SamplingParams(max_tokens=28, repetition_penalty=1.2, min_tokens=8, stop_token_ids=[NEWLINE]),
            SamplingParams(max_tokens=28),
            SamplingParams(max_tokens=28, temperature=0.9, seed=7, min_p=0.1, repetition_penalty=1.3, min_tokens=6),
            SamplingParams(max_tokens=28, temperature=0.9, seed=8),
            SamplingParams(max_tokens=28, repetition_penalty=0.8, min_tokens=20, stop="\n", stop_token_ids=[NEWLINE])]


def test_both_loops_and_mtp_give_equal_tokens_with_every_field(engines):
    """Normal and overlap loops give the same tokens, greedy and seeded, in a batch that mixes the fields;
    MTP (k=3) in both loops gives the same tokens as each other, and greedy ones equal plain decoding."""
    prompts = CODE_PROMPTS[:len(mixed_params())]
    runs = {(overlap, mtp): [(o.token_ids, o.text, o.finish_reason) for o in engines(overlap, mtp).generate(prompts, mixed_params())]
            for overlap in (False, True) for mtp in (0, 3)}
    assert runs[False, 0] == runs[True, 0]
    assert runs[False, 3] == runs[True, 3]
    greedy = [i for i, p in enumerate(mixed_params()) if p.temperature == 0]
    assert [runs[True, 3][i] for i in greedy] == [runs[True, 0][i] for i in greedy]


@pytest.mark.skipif("ngram_steps" not in EngineArgs.__dataclass_fields__, reason="the n-gram drafter: chapter 19")
def test_ngram_drafts_are_judged_with_the_fields():
    """The n-gram drafter's verify (chapter 19) judges its drafts by the same adjusted logits: greedy lossless."""
    plain = engines_tokens(LLM(model="tiny", max_seq_len=SEQ_LEN))
    assert engines_tokens(LLM(model="tiny", max_seq_len=SEQ_LEN, ngram_steps=3)) == plain


def engines_tokens(llm: LLM) -> list[list[int]]:
    params = [p for p in mixed_params() if p.temperature == 0]
    return [o.token_ids for o in llm.generate(CODE_PROMPTS[:len(params)], params)]


@pytest.mark.parametrize("mtp", [0, 3])
def test_the_hazard_checker_is_silent(mtp):
    """The penalty's reads of token_pool are recorded, and race nothing the scheduler writes."""
    llm = LLM(model="tiny", overlap=True, mtp_steps=mtp, hazard_check=True, max_seq_len=SEQ_LEN, max_running=2)
    outs = llm.generate(CODE_PROMPTS[:4], mixed_params()[:4])
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    llm.check_integrity()


# ---- skip_special_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_skip_special_tokens(engines, overlap):
    """The text leaves special tokens out unless the request keeps them: LLM.generate's text, and the text
    stream where stop strings are found (a stop string spelled as a special token ends only a request that
    keeps them)."""
    llm = engines(overlap, 0)
    keep, skip = (SamplingParams(max_tokens=6, ignore_eos=True, skip_special_tokens=s) for s in (False, True))
    kept, skipped = (llm.generate([EOS_FIRST], p)[0] for p in (keep, skip))
    assert kept.token_ids == skipped.token_ids and kept.token_ids[0] == 0
    tokenizer = llm.processor.tokenizer
    assert kept.text == tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    assert kept.text.startswith("<|endoftext|>")
    assert skipped.text == tokenizer.decode(kept.token_ids, skip_special_tokens=True) == kept.text[len("<|endoftext|>"):]
    for s, reason, n in ((False, "stop", 1), (True, "length", 6)):
        out = llm.generate([EOS_FIRST], SamplingParams(max_tokens=6, ignore_eos=True, stop="<|endoftext|>",
                                                       skip_special_tokens=s))[0]
        assert (out.finish_reason, len(out.token_ids)) == (reason, n)
    assert out.text == skipped.text


# ---- bad values


@pytest.mark.skipif("regex" not in SamplingParams.__dataclass_fields__, reason="grammars: chapter 19")
def test_min_tokens_with_a_grammar_is_refused():
    """A grammar may end the output before min_tokens tokens, where it allows EOS alone, which min_tokens
    forbids: refused, rather than a request with no token left to choose."""
    with pytest.raises(ValueError, match=r"min_tokens must be 0 with a grammar \(regex\), got 3"):
        SamplingParams(max_tokens=8, min_tokens=3, regex="[a-z]+")
    SamplingParams(max_tokens=8, regex="[a-z]+")


@pytest.mark.parametrize("field, value, limit", [
    ("min_p", -0.1, "in [0, 1]"), ("min_p", 1.5, "in [0, 1]"), ("min_p", math.nan, "in [0, 1]"),
    ("min_p", True, "in [0, 1]"), ("min_p", "0.1", "in [0, 1]"),
    ("repetition_penalty", 0.0, "in (0, 2]"), ("repetition_penalty", -1.0, "in (0, 2]"),
    ("repetition_penalty", 2.5, "in (0, 2]"), ("repetition_penalty", math.inf, "in (0, 2]"),
    ("repetition_penalty", math.nan, "in (0, 2]"), ("repetition_penalty", None, "in (0, 2]"),
    ("min_tokens", -1, ">= 0"), ("min_tokens", 1.0, ">= 0"), ("min_tokens", True, ">= 0"),
    ("min_tokens", 17, "<= max_tokens (16)"),
    ("skip_special_tokens", 1, "True or False"), ("skip_special_tokens", None, "True or False"),
])
def test_bad_values_are_refused(field, value, limit):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and limit in str(e.value) and repr(value) in str(e.value)


def test_good_values_are_kept():
    p = SamplingParams(min_p=1, repetition_penalty=2, min_tokens=16, skip_special_tokens=False)
    assert (p.min_p, p.repetition_penalty, p.min_tokens, p.skip_special_tokens) == (1.0, 2.0, 16, False)
    assert type(p.min_p) is float and type(p.repetition_penalty) is float
    defaults = SamplingParams()
    assert (defaults.min_p, defaults.repetition_penalty, defaults.min_tokens, defaults.skip_special_tokens) == (0.0, 1.0, 0, True)
