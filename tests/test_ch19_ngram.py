"""Chapter 19: the n-gram drafter on the host (prompt lookup decoding). The lookup takes the longest match
first, its most recent occurrence, and cuts its proposal where the sequence ends; every decode step is a
verify window whose tokens equal plain greedy decoding's in both loops, with the prefix cache on or off
and with chunked prefill, the checker silent; the accept length is reported; seeded sampling repeats in
both loops; the overlap loop waits for and handles each step before it builds the next (the lookup needs
its tokens); an abort leaves the engine as good as new; bad options are refused naming them."""

from __future__ import annotations

import pytest

from conftest import bounded_loop
from minioverlap import LLM, SamplingParams
from minioverlap.cli import engine_options, parser
from minioverlap.speculative.ngram import NgramRunner, ngram_draft

REPEAT = "x = [1, 2, 3]\nprint(x)\n" * 4                  # a phrase repeated: the lookups hit
PROMPTS = ["def fibonacci(n):", REPEAT, [5, 6, 7], "a b c d a b c d a b", "class Stack:\n    def __init__(self):"]
LONG = "import os\n" + REPEAT * 2                          # longer than a chunk of 16 tokens
PARAMS = [SamplingParams(max_tokens=n) for n in (40, 24, 1, 33, 17)]

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one torch thread for the module


ROUNDS = 1000       # the loop's rounds a run here may take: under 100 each (a wrong drafter could loop forever)


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    with bounded_loop(llm, ROUNDS):
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    """Plain greedy decoding, no drafter, the normal loop: the tokens every n-gram run must give."""
    llm = LLM(overlap=False, prefix_cache=False, chunked_prefill_size=-1)
    return {"batch": tokens_of(llm, PROMPTS, PARAMS), "long": tokens_of(llm, [LONG, "def add(a, b):"], PARAMS[:2])}


# ---- the lookup

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, [9, 2]),          # n=3 matches (1 2 3 at 0), n=2's later 2 3 at 4 loses
    ([1, 2, 5, 2, 6, 2], 2, [6, 2]),                      # n=1: the most recent earlier 2, at 3
    ([7, 8, 9, 7, 8], 4, [9, 7, 8]),                      # the proposal is cut where the sequence ends
    ([4, 4, 4], 3, [4]),                                  # the suffix itself is no match; overlaps are
    ([1, 2, 3, 4], 3, []),                                # nothing repeats
    ([5], 2, []),                                         # nothing before the suffix
    ([], 2, []),
], ids=["longest-first", "most-recent", "cut-at-end", "overlap", "no-match", "one-token", "empty"])
def test_the_lookup_takes_the_longest_n_and_its_most_recent_occurrence(tokens, k, expected):
    assert ngram_draft(tokens, k) == expected


def test_the_lookup_respects_max_n_and_min_n():
    tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    assert ngram_draft(tokens, 2, max_n=2) == [7, 1], "n=2: the most recent 2 3, at 4"
    assert ngram_draft([1, 2, 5, 2, 6, 2], 2, min_n=2) == [], "no match of 2 tokens"


# ---- equal tokens

@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_tokens_equal_plain_greedy(plain, overlap, k, cache):
    """Five prompts (two that repeat themselves), max_tokens 1..40, fewer request slots than prompts, the
    checker on: plain greedy's tokens, twice (with the cache on, the second run hits it), integrity after."""
    llm = LLM(overlap=overlap, ngram_steps=k, prefix_cache=cache, hazard_check=True, max_running=3, page_size=4)
    for _ in range(2):
        assert tokens_of(llm, PROMPTS, PARAMS) == plain["batch"]
        llm.check_integrity()
    assert any(e.kind == "hit" for e in llm.trace) == cache


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_chunked_prefill_gives_plain_greedy(plain, overlap):
    """A prompt longer than the budget of 16 prefilled in chunks, then verify windows: plain greedy's tokens."""
    llm = LLM(overlap=overlap, ngram_steps=3, chunked_prefill_size=16, hazard_check=True)
    assert tokens_of(llm, [LONG, "def add(a, b):"], PARAMS[:2]) == plain["long"]
    assert any(e.kind == "chunk" for e in llm.trace), "the long prompt was not chunked"
    llm.check_integrity()


def test_the_accept_length_is_reported():
    """On a prompt that repeats itself, fewer target passes (the prefill and the verify steps) than tokens,
    each step's lookup timed; none counted without a drafter."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    llm = LLM(ngram_steps=4)
    [out] = llm.generate([REPEAT], params)
    assert isinstance(llm.runner, NgramRunner)
    assert 0 < out.verify_steps < len(out.token_ids) == 32
    assert len(llm.runner.lookup_ns) == out.verify_steps - 1, "one lookup per verify step (not the prefill)"
    assert LLM().generate([REPEAT], params)[0].verify_steps == 0


def test_seeded_sampling_repeats_in_both_loops():
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=s) for s in (1, 2)]
    prompts = [REPEAT, "def fibonacci(n):"]
    runs = [tokens_of(LLM(overlap=overlap, ngram_steps=3), prompts, params) for overlap in (False, True)]
    assert runs[0] == runs[1]


# ---- the overlap loop waits

def test_the_overlap_loop_handles_each_step_before_it_builds_the_next():
    """One request: wait N, handle N, schedule N+1, launch N+1, and never a launch before the wait."""
    llm = LLM(overlap=True, ngram_steps=3)
    llm.generate([REPEAT], SamplingParams(max_tokens=20, ignore_eos=True))
    order = llm.trace.order(("schedule", "launch", "wait", "process"))
    steps = max(e.step for e in llm.trace if e.kind == "launch")
    assert steps >= 3
    assert order == [f"{kind} {n}" for n in range(1, steps + 1) for kind in ("schedule", "launch", "wait", "handle")]


# ---- aborts

@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("how", ["break", "abort"])
def test_an_abort_mid_stream_leaves_the_engine_as_new(overlap, how):
    """Leave a stream (or abort its request) after two replies: every page and slot free, and the engine
    then gives what a fresh one gives."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    llm = LLM(overlap=overlap, ngram_steps=3, hazard_check=True, page_size=4)
    with bounded_loop(llm, ROUNDS):
        for i, reply in enumerate(llm.stream([REPEAT, "def fibonacci(n):"], params)):
            if i == 2 and how == "break":
                break
            if i == 2:
                llm.abort(0)
    llm.check_integrity()
    assert llm.runner.free_pages == llm.runner.usable_pages
    again = [REPEAT, [5, 6, 7]]
    assert tokens_of(llm, again, params) == tokens_of(LLM(overlap=overlap, ngram_steps=3, page_size=4), again, params)
    llm.check_integrity()


# ---- options

@pytest.mark.parametrize("options, message", [
    ({"ngram_steps": 3, "mtp_steps": 2}, "ngram_steps=3 and mtp_steps=2: one drafter at a time"),
    ({"ngram_steps": -1}, r"ngram_steps must be an integer in \[0, 16\], got -1"),
    ({"ngram_steps": True}, "ngram_steps must be an integer in"),
    ({"ngram_steps": 2.5}, "ngram_steps must be an integer in"),
    ({"ngram_steps": 17}, r"ngram_steps must be an integer in \[0, 16\], got 17"),
    ({"ngram_steps": 3, "mixed_chunk": True}, "mixed_chunk=True with ngram_steps=3: every decode step is a verify"),
], ids=["with-mtp", "negative", "bool", "float", "too-many", "mixed"])
def test_a_bad_option_is_refused_with_its_name_value_and_limit(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(**options)


@pytest.mark.parametrize("command", [["generate", "hello"], ["trace"], ["serve"]])
def test_the_command_line_passes_ngram(command):
    args = parser().parse_args([*command, "--ngram", "3"])
    assert engine_options(args)["ngram_steps"] == 3
    assert "ngram_steps" not in engine_options(parser().parse_args(command))
