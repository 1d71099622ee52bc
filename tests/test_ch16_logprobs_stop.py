"""Chapter 16: two fields OpenAI's clients send, served by the engine itself. logprobs equal a
recomputation from the model (transformers, a full forward over prompt and output), in both loops, with
and without MTP, greedy and seeded sampling, in batches that mix requests that ask with requests that do
not; each reply's logprobs are those of exactly its tokens. Stop strings end a request on the token that
completes one, in both loops, with and without MTP (inside a window too); the text is cut before it."""

from __future__ import annotations

import pytest
import torch

from conftest import CODE_PROMPTS, TINY, _hf_model, random_checkpoint
from minioverlap import LLM, SamplingParams
from minioverlap.model.loader import load_tokenizer
from minioverlap.text import TextStream, find_stop

SEQ_LEN = 128
TOLERANCE = 1e-4                     # fp32 on the CPU, the engine's kernels against transformers'
LOOPS = [pytest.param(overlap, mtp, id=f"{'overlap' if overlap else 'normal'}-mtp{mtp}")
         for overlap in (False, True) for mtp in (0, 3)]

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def engines():
    """engines(overlap, mtp_steps): one engine of the tiny model per setting, for the module."""
    made: dict[tuple, LLM] = {}

    def get(overlap: bool, mtp_steps: int) -> LLM:
        if (overlap, mtp_steps) not in made:
            made[overlap, mtp_steps] = LLM(model="tiny", overlap=overlap, mtp_steps=mtp_steps, max_seq_len=SEQ_LEN)
        return made[overlap, mtp_steps]

    yield get
    made.clear()


def reference_logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position: one forward over prompt + output."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = _hf_model(str(TINY))(ids).logits[0, len(prompt) - 1:].float()
    return logits.log_softmax(dim=-1)


def largest_difference(out, k: int) -> float:
    """Check out.logprobs against the recomputation; return the largest absolute difference."""
    ref = reference_logprobs(out.prompt_token_ids, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    worst = 0.0
    for j, (lp, token) in enumerate(zip(out.logprobs, out.token_ids)):
        worst = max(worst, abs(lp.logprob - ref[j, token].item()))
        values, ids = ref[j].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        worst = max([worst] + [abs(v - r) for (_, v), r in zip(lp.top, values.tolist())])
    assert worst < TOLERANCE
    return worst


# ---- logprobs

@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_logprobs_equal_a_recomputation_from_the_model(engines, overlap, mtp):
    llm = engines(overlap, mtp)
    params = [SamplingParams(max_tokens=12, logprobs=5),
              SamplingParams(max_tokens=10),                                      # asks for none
              SamplingParams(max_tokens=11, temperature=0.8, seed=7, logprobs=0),
              SamplingParams(max_tokens=9, temperature=1.0, top_k=20, top_p=0.9, seed=3, logprobs=20),
              SamplingParams(max_tokens=7, logprobs=1)]
    outs = llm.generate(CODE_PROMPTS, params)
    assert outs[1].logprobs is None
    worst = max(largest_difference(out, p.logprobs) for out, p in zip(outs, params) if p.logprobs is not None)
    print(f"largest |logprob - recomputed|: {worst:.2e}")
    for out, p in zip(outs, params):
        if p.logprobs and p.temperature == 0:       # greedy: the chosen token is the top one
            assert all(lp.top[0] == (t, lp.logprob) for lp, t in zip(out.logprobs, out.token_ids))
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_logprobs_are_the_raw_distribution_not_the_sampled_one(engines, overlap, mtp):
    """A low temperature sharpens what the request draws from, not the logprobs it gets back."""
    llm = engines(overlap, mtp)
    [out] = llm.generate([CODE_PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.3, seed=1, logprobs=3))
    largest_difference(out, 3)
    llm.check_integrity()


def test_the_logprobs_cost_nothing_when_no_request_asks(engines):
    """No log_softmax runs in a step whose requests did not ask (the model itself has none)."""
    def computed(*args, **kwargs):
        raise AssertionError("a step computed logprobs that no request asked for")

    llm = engines(True, 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "log_softmax", computed)
        outs = llm.generate(CODE_PROMPTS[:2], SamplingParams(max_tokens=5))
    assert [o.logprobs for o in outs] == [None, None]
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_each_reply_carries_the_logprobs_of_exactly_its_tokens(engines, overlap, mtp):
    """Streamed: every reply's logprobs line up with its tokens, through early finishes (max_tokens and
    a stop string inside a window), the stale replies of the overlap loop, and an abort."""
    llm = engines(overlap, mtp)
    params = [SamplingParams(max_tokens=n, logprobs=2, ignore_eos=True) for n in (1, 2, 5, 8)]
    params += [SamplingParams(max_tokens=20, logprobs=0, stop=["n"]), SamplingParams(max_tokens=30, logprobs=4)]
    first = llm.next_uid
    got: list[tuple[list, list]] = [([], []) for _ in params]
    for reply in llm.stream(CODE_PROMPTS + [CODE_PROMPTS[0]], params):
        tokens, logprobs = got[reply.uid - first]
        if reply.token_ids:
            assert len(reply.logprobs) == len(reply.token_ids)
            tokens += reply.token_ids
            logprobs += reply.logprobs
        if reply.uid - first == 5 and len(tokens) >= 3 and not reply.finished:
            llm.abort(reply.uid)                          # the last request, aborted with steps in flight
    assert 3 <= len(got[5][0]) < 30
    outs = llm.generate(CODE_PROMPTS, params[:5])
    for out, (tokens, logprobs) in zip(outs, got):
        assert tokens == out.token_ids and len(out.logprobs) == len(tokens)
        assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in out.logprobs], abs=TOLERANCE)
    llm.check_integrity()


# ---- stop strings

def pieces(llm: LLM, token_ids: list[int]) -> list[str]:
    """Each token's text as the output grows (a piece is empty until its character is complete)."""
    texts = [llm.decode(token_ids[:n]) for n in range(len(token_ids) + 1)]
    return [texts[n + 1][len(texts[n]):] if texts[n + 1].startswith(texts[n]) and "\ufffd" not in texts[n + 1] else ""
            for n in range(len(token_ids))]


def expected(llm: LLM, token_ids: list[int], stop: list[str]) -> tuple[list[int], str]:
    """An unconstrained run's tokens up to the one that completes the first stop string, and its text
    cut before that stop string."""
    n = next(n for n in range(1, len(token_ids) + 1) if find_stop(llm.decode(token_ids[:n]), tuple(stop)) is not None)
    text = llm.decode(token_ids[:n])
    return token_ids[:n], text[:find_stop(text, tuple(stop))]


def free_run(llm: LLM) -> list:
    return llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=40))


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_a_stop_string_ends_the_request_at_its_first_occurrence(engines, overlap, mtp):
    llm = engines(overlap, mtp)
    free = free_run(llm)[0]
    parts = pieces(llm, free.token_ids)
    i = next(i for i in range(4, len(parts) - 1) if len(parts[i]) >= 2 and len(parts[i + 1]) >= 2)
    cases = {
        "two tokens": [parts[i][-2:] + parts[i + 1][:2]],                       # spans the two tokens' texts
        "one token": [parts[i + 1]],
        "mid-token": [parts[i + 1][1:]],                                       # the text is cut inside a token
        "first of two": ["@@never@@", parts[i + 1], parts[i]],                 # the earliest one counts
    }
    for name, stop in cases.items():
        [out] = llm.generate([CODE_PROMPTS[0]], SamplingParams(max_tokens=40, stop=stop))
        tokens, text = expected(llm, free.token_ids, stop)
        assert (out.token_ids, out.text, out.finish_reason) == (tokens, text, "stop"), name
        assert len(out.token_ids) < len(free.token_ids), name
        llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_a_stop_string_that_never_occurs_changes_nothing(engines, overlap, mtp):
    llm = engines(overlap, mtp)
    free = free_run(llm)
    outs = llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=40, stop=["@@never@@", "\x00"]))
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [(o.token_ids, o.text, o.finish_reason) for o in free]
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_a_request_with_stop_strings_among_others_leaves_them_unchanged(engines, overlap, mtp):
    llm = engines(overlap, mtp)
    free = free_run(llm)
    stops = [pieces(llm, o.token_ids)[6] or "\n" for o in free]
    params = [SamplingParams(max_tokens=40, stop=[s]) if k % 2 == 0 else SamplingParams(max_tokens=40)
              for k, s in enumerate(stops)]
    outs = llm.generate(CODE_PROMPTS, params)
    for k, (out, f) in enumerate(zip(outs, free)):
        if k % 2:
            assert (out.token_ids, out.text, out.finish_reason) == (f.token_ids, f.text, f.finish_reason)
        else:
            assert (out.token_ids, out.text, out.finish_reason) == (*expected(llm, f.token_ids, [stops[k]]), "stop")
    llm.check_integrity()


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_nothing_after_the_stop_is_sent(engines, overlap, mtp):
    """Streamed: the request's last reply ends with the token that completed the stop string, and no
    reply follows it (the overlap loop's extra step for it is dropped)."""
    llm = engines(overlap, mtp)
    free = free_run(llm)[1]
    stop = pieces(llm, free.token_ids)[5]
    replies = list(llm.stream([CODE_PROMPTS[1]], SamplingParams(max_tokens=40, stop=[stop])))
    assert replies[-1].finished and replies[-1].finish_reason == "stop"
    assert [t for r in replies for t in r.token_ids] == expected(llm, free.token_ids, [stop])[0]
    llm.check_integrity()


def test_the_text_stream_never_sends_a_stop_string_or_a_part_of_one():
    tokenizer = load_tokenizer(TINY)
    text = 'x = "日本" + y\n    return x'
    ids = tokenizer.encode(text).ids
    for stop in (("return",), ("本\"",), ("@@",), ("x\n", "+ y"), ("日",)):
        stream, sent, cut = TextStream(tokenizer, stop), "", text[:find_stop(text, stop)]
        for n, token in enumerate(ids):
            sent += stream.add([token], finished=n == len(ids) - 1)
            assert cut.startswith(sent), (stop, sent)      # nothing sent is ever taken back
        assert sent == cut, stop


def test_the_text_stream_decodes_a_character_split_across_tokens():
    tokenizer = load_tokenizer(TINY)
    ids = tokenizer.encode("日本語").ids
    assert len(ids) > 3                                   # bytes of one character, in several tokens
    stream = TextStream(tokenizer, ("本",))
    found = [stream.holds_stop(ids[:n]) for n in range(1, len(ids) + 1)]
    completes = next(n for n in range(1, len(ids) + 1) if "本" in tokenizer.decode(ids[:n]))
    assert found == [n >= completes for n in range(1, len(ids) + 1)]
    assert stream.text == "日本語"


# ---- bad values

@pytest.mark.parametrize("field, value, words", [
    ("stop", [""], ["stop[0]", "non-empty"]),
    ("stop", ["a", 3], ["stop[1]", "3"]),
    ("stop", 7, ["stop", "7"]),
    ("stop", ["s"] * 17, ["stop", "17", "16"]),
    ("logprobs", 21, ["logprobs", "21", "20"]),
    ("logprobs", -1, ["logprobs", "-1"]),
    ("logprobs", 2.0, ["logprobs", "2.0"]),
    ("logprobs", True, ["logprobs", "True"]),
])
def test_bad_values_are_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_stop_string_needs_a_tokenizer(tmp_path):
    llm = LLM(model=str(random_checkpoint(tmp_path / "no-tokenizer")), max_seq_len=64)
    with pytest.raises(ValueError, match="stop"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, stop="x"))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=2))[0].logprobs) == 3
    llm.check_integrity()
