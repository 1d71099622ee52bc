"""Chapter 21: admission by need and retraction. Pools overcommitted 2x and 4x (both loops, MTP off and
on, chunked or whole prompts, with and without the prefix cache) give the tokens of a pool that holds
every request whole, with the hazard checker silent and every page accounted for; a seeded request keeps
its draws; the event order of a retraction in each loop; aborts of a request taken back; the estimate,
the order and the rules of the step in flight."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minioverlap import LLM, SamplingParams
from minioverlap.cli import engine_options, parser
from minioverlap.config import Guards
from minioverlap.engine.request import Req
from minioverlap.scheduler.retraction import (CLIP_MAX_NEW_TOKENS, DECAY_STEPS, NewTokenRatio, RETRACT_DECODE_STEPS,
                                              growth_pages, retraction_order)
from conftest import assert_as_fresh, over_ranks, probe_tokens
from serving import Server

PROMPTS = [[(7 * i + j) % 50 + 3 for j in range(5 + 2 * i)] for i in range(12)]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
RATIO = 0.4          # low, so that the small runs here overcommit enough to take requests back


def worst_case_pages(prompts: list[list[int]], max_tokens: int, page_size: int, slack: int = 0) -> int:
    """Pages for every request of the run to hold its whole context at once."""
    return sum(math.ceil((len(p) + max_tokens - 1 + slack) / page_size) for p in prompts)


def engine(over: int | None, **options) -> LLM:
    """max_running 8, pages of 4; a pool `over` times smaller than the run's worst case (None: the default
    pool, every request slot a whole context, and admission by every page)."""
    if over is None:
        return LLM(page_size=4, max_running=8, **options)
    slack = 2 * options.get("mtp_steps", 0) + 1 if options.get("mtp_steps") else 0
    pages = worst_case_pages(PROMPTS, GREEDY.max_tokens, 4, slack) // over + 1
    return LLM(page_size=4, max_running=8, num_pages=pages, new_token_ratio=RATIO, hazard_check=True, **options)


REFERENCE: dict = {}


def reference(params: SamplingParams = GREEDY, **options) -> list[list[int]]:
    key = (repr(params), tuple(sorted(options.items())))
    if key not in REFERENCE:
        REFERENCE[key] = [o.token_ids for o in engine(None, **options).generate(PROMPTS, params)]
    return REFERENCE[key]


@pytest.mark.parametrize("over", [2, 4])
@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("chunk", [-1, 8], ids=["whole", "chunk8"])
@pytest.mark.parametrize("mtp", [0, 3], ids=["plain", "mtp3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_an_overcommitted_pool_gives_the_worst_case_pool_s_tokens(overlap, mtp, chunk, cache, over):
    """Requests are taken back, and every token equals the engine's whose pool holds them all whole; the
    hazard checker is silent, and afterwards every page is free (or the tree's, evictable) again."""
    options = dict(overlap=overlap, mtp_steps=mtp, chunked_prefill_size=chunk, prefix_cache=cache)
    llm = engine(over, **options)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference(**options)
    assert llm.scheduler.retraction.count > 0, "nothing was taken back: the test proves nothing"
    llm.check_integrity()
    assert llm.runner.free_pages == llm.runner.usable_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_retracted_seeded_request_keeps_its_draws(overlap):
    """Seeded sampling: a retracted request keeps its generator, so its next draw is the one it would
    have made (a new generator would start its seed again). Without MTP: a verify window draws for each
    of its positions, so where a seeded request's windows fall decides its draws (chapter 09), and a
    retraction moves them (the tokens are a sample of the same distribution, not the same sample)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=5)
    llm = engine(4, overlap=overlap)
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.retraction.count > 0
    assert [o.token_ids for o in outs] == reference(params, overlap=overlap)


def two_requests(overlap: bool, **options) -> LLM:
    """Two requests admitted together on a low estimate into 6 free pages of 4 tokens: at 12 tokens each
    they hold 3 pages each, and the next decode step needs one more each: one is taken back."""
    return LLM(page_size=4, max_running=2, num_pages=7, new_token_ratio=0.1, overlap=overlap, prefix_cache=False,
               **options)


TWO = [[3, 4, 5, 6], [7, 8, 9, 10, 11]]               # request 1's prompt is the longer: it goes first
TWELVE = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_event_order_of_a_retraction(overlap):
    """Normal loop: step N is handled, then the retraction, then step N+1 without the request. Overlap
    loop: the retraction comes as step N+1 is scheduled with N in flight; N+1 is launched without the
    request, N is handled as it was launched: the request's token of N reaches its client. Its prefill
    comes again once the other request has finished, and it ends with the tokens of a run alone."""
    llm = two_requests(overlap)
    outs = llm.generate(TWO, TWELVE)
    events = [(e.kind, e.step, e.uids) for e in llm.trace]
    retract = next(e for e in events if e[0] == "retract")
    n = retract[1]
    assert retract == ("retract", n, (1,))
    i = events.index(retract)
    if overlap:
        assert events[i:i + 6] == [("retract", n, (1,)), ("schedule", n, (0,)), ("launch", n, (0,)),
                                   ("wait", n - 1, (0, 1)), ("process", n - 1, (0, 1)), ("reply", n - 1, (0, 1))]
    else:
        assert events[i - 2:i + 4] == [("process", n - 1, (0, 1)), ("reply", n - 1, (0, 1)), ("retract", n, (1,)),
                                       ("schedule", n, (0,)), ("launch", n, (0,)), ("wait", n, (0,))]
    again = next(step for kind, step, uids in events if kind == "schedule" and step > n and 1 in uids)
    assert ("process", again - 1, (0,)) in events[:events.index(("schedule", again, (1,)))], \
        "it comes back only after request 0 has finished"
    alone = [LLM(page_size=4, overlap=overlap).generate([p], TWELVE)[0].token_ids for p in TWO]
    assert [o.token_ids for o in outs] == alone
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("when", ["waiting", "refilling"])
def test_an_abort_of_a_retracted_request_leaves_the_engine_as_good_as_new(overlap, when):
    """Abort the request taken back while it waits to come back (in the overlap loop, with its last step
    still in flight), or as its prefill comes again: it ends with "abort", the other request's tokens are
    untouched, and the engine then serves as a fresh one does."""
    fresh = probe_tokens(LLM(page_size=4, overlap=overlap))
    llm = two_requests(overlap)
    scheduler, aborted = llm.scheduler, []
    retraction = scheduler.retraction
    make_room, schedule = retraction.make_room, scheduler.schedule

    def abort_after_retraction(reqs, new, decode):
        kept = make_room(reqs, new, decode)
        if when == "waiting" and retraction.count and not aborted:
            llm.abort(1)
            aborted.append(True)
        return kept

    def abort_at_refill():
        batch = schedule()
        if when == "refilling" and batch is not None and retraction.count and 1 in [r.uid for r in batch.reqs]:
            llm.abort(1)
            aborted.append(True)
        return batch

    retraction.make_room, scheduler.schedule = abort_after_retraction, abort_at_refill
    outs = {o.uid: o for o in llm.generate(TWO, TWELVE)}
    retraction.make_room, scheduler.schedule = make_room, schedule
    assert aborted
    assert outs[1].finish_reason == "abort"
    assert outs[0].token_ids == LLM(page_size=4, overlap=overlap).generate([TWO[0]], TWELVE)[0].token_ids
    assert_as_fresh(llm, fresh)


def test_with_the_release_deferred_and_no_fence_a_retraction_is_no_race():
    """Chapter 07's guard alone (no fence): a retracted request's slot and pages wait until the step in
    flight that holds them is handled, as a finished request's do; the hazard checker stays silent."""
    llm = LLM(page_size=4, max_running=8, new_token_ratio=RATIO, hazard_check=True, overlap=True,
              guards=Guards(fence=False, defer_release=True),
              num_pages=worst_case_pages(PROMPTS, 40, 4) // 4 + 1)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.retraction.count > 0
    assert [o.token_ids for o in outs] == reference(overlap=True)
    llm.check_integrity()


def test_retractions_do_not_storm():
    """After a retraction the estimate is raised to what the requests kept have made: admission turns
    cautious instead of admitting again, on the old estimate, what it must soon take back. Here (a pool
    half the run's worst case) no request is taken back twice; on the old estimate some are."""
    llm = engine(2, overlap=True)
    llm.generate(PROMPTS, GREEDY)
    taken = [uid for e in llm.trace if e.kind == "retract" for uid in e.uids]
    assert taken, "nothing was taken back: the test proves nothing"
    assert len(taken) == len(set(taken)), f"taken back more than once: {sorted(taken)}"


def test_admission_by_need_runs_more_requests_at_once_in_the_same_pool():
    """The same pool: admission by every page a request may need runs fewer requests at once than
    admission by need."""
    pages = worst_case_pages(PROMPTS, GREEDY.max_tokens, 4) // 4 + 1

    def most_at_once(**options) -> int:
        llm = LLM(page_size=4, max_running=8, num_pages=pages, overlap=False, **options)
        llm.generate(PROMPTS, GREEDY)
        return max(len(e.uids) for e in llm.trace if e.kind == "schedule")

    assert most_at_once(new_token_ratio=0.7) > most_at_once()


# ---- the parts, one by one

def req(prompt: int, outputs: int, max_tokens: int = 50) -> Req:
    r = Req(uid=0, prompt_ids=list(range(prompt)), params=SamplingParams(), max_new_tokens=max_tokens)
    r.output_ids = [1] * outputs
    return r


def test_the_retraction_order_is_fewest_outputs_then_longest_prompt():
    a, b, c, d = req(10, 5), req(30, 2), req(20, 2), req(5, 9)
    assert retraction_order([a, b, c, d]) == [b, c, a, d]


def test_the_ratio_decays_to_its_floor_resets_and_rises_after_a_retraction():
    ratio = NewTokenRatio(0.7)
    for _ in range(DECAY_STEPS // 2):
        ratio.step()
    assert ratio.value == pytest.approx(0.7 - (0.7 - 0.098) / 2)
    for _ in range(DECAY_STEPS):
        ratio.step()
    assert ratio.value == pytest.approx(0.098)
    ratio.raise_after([req(10, 10, max_tokens=60), req(10, 20, max_tokens=60)])
    assert ratio.value == pytest.approx((30 + 2 * RETRACT_DECODE_STEPS) / 120)
    ratio.reset()
    assert ratio.value == 0.7


def test_the_growth_estimate_counts_the_rest_of_the_fill_and_a_share_of_the_tokens_left():
    pages_for = lambda n: math.ceil(n / 4)
    waiting = req(10, 0)
    assert growth_pages(pages_for, waiting, 10 + 50 - 1, 0.5) == pages_for(10 + math.ceil(49 * 0.5))
    running = req(10, 6)
    running.seq_len, running.pages = 15, [1, 2, 3, 4]
    assert growth_pages(pages_for, running, 59, 0.5) == pages_for(15 + 22) - 4
    assert growth_pages(pages_for, req(10, 0, max_tokens=100_000), 100_009, 1.0) == pages_for(10 + CLIP_MAX_NEW_TOKENS)


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), "0.7", True])
def test_a_bad_new_token_ratio_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"new_token_ratio must be a real number in \(0, 1\]"):
        LLM(new_token_ratio=value)


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"], ["trace"]])
def test_the_flag_reaches_the_engine_options(command):
    """--new-token-ratio R becomes new_token_ratio=R; left out, admission stays by every page."""
    assert engine_options(parser().parse_args([*command, "--new-token-ratio", "0.7"]))["new_token_ratio"] == 0.7
    assert "new_token_ratio" not in engine_options(parser().parse_args(command))


def test_a_new_token_ratio_needs_the_prefill_to_write_its_tokens():
    with pytest.raises(ValueError, match="new_token_ratio=0.7 needs Guards\\(prompt_on_forward_stream=True\\)"):
        LLM(new_token_ratio=0.7, guards=Guards(prompt_on_forward_stream=False))


def test_no_retraction_where_the_requests_finishing_in_the_step_in_flight_free_enough():
    """The overlap loop, requests of 8 to 32 tokens: when the pages short are fewer than those of the
    requests whose last step is in flight, the loop handles that step before it launches another (their
    pages come back) instead of taking a request back (SGLang v0.5.22's rule). Here that saves every
    retraction: counting them as if they went on takes two requests back."""
    params = [SamplingParams(max_tokens=8 + i % 4 * 8, ignore_eos=True) for i in range(len(PROMPTS))]
    pages = sum(math.ceil((len(p) + s.max_tokens - 1) / 4) for p, s in zip(PROMPTS, params)) // 2 + 1
    llm = LLM(page_size=4, max_running=8, num_pages=pages, new_token_ratio=0.3, prefix_cache=False, hazard_check=True)
    outs = llm.generate(PROMPTS, params)
    want = LLM(page_size=4, max_running=8, prefix_cache=False).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.scheduler.retraction.count == 0
    llm.check_integrity()


def stream_tokens(url: str, prompt: list[int]) -> tuple[list[int], dict]:
    """One streamed completion of token ids, greedy: its tokens in the order they came, and its usage."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 0}
    tokens, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    tokens += choice["logprobs"]["tokens"] if choice.get("logprobs") else []
    return tokens, usage


@pytest.mark.process
def test_a_server_that_takes_requests_back_streams_each_whole_and_says_how_many():
    """minioverlap serve --new-token-ratio 0.4 with a pool a quarter of the run's worst case, twelve streams
    at once: each stream pauses while its request is taken back and resumes, and gets the tokens of an
    engine whose pool holds them all; its usage counts each token once; /integrity reports the
    retractions, and everything free once idle."""
    tokens = 16 * (worst_case_pages(PROMPTS, GREEDY.max_tokens, 16) // 4 + 1)
    server = Server("--max-running", "8", "--max-total-tokens", str(tokens), "--max-seq-len", "128",
                    "--new-token-ratio", str(RATIO), "--no-prefix-cache")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = list(pool.map(lambda p: stream_tokens(server.url, p), PROMPTS))
        report = server.wait_idle()
    finally:
        code, output = server.stop()
    assert code == 0, output
    want = [o.token_ids for o in LLM(max_running=8).generate(PROMPTS, GREEDY)]
    decode = LLM().tokenizer
    assert [got for got, _ in streams] == [[decode.decode([t]) for t in w] for w in want]
    assert all(u["completion_tokens"] == GREEDY.max_tokens and u["prompt_tokens"] == len(p)
               for (_, u), p in zip(streams, PROMPTS))
    assert report["retractions"] > 0, report
    assert report["problems"] is None and report["free_pages"] == report["usable_pages"]


@pytest.mark.process
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("dp", [False, True], ids=["tp2", "dp2"])
def test_ranks_take_requests_back_and_keep_one_device_s_tokens(dp, overlap):
    """Two gloo ranks, a quarter of the run's worst case for each rank's pool. Tensor parallelism: both
    ranks decide the same retractions from the same state, and their steps stay alike. DP attention: each
    rank takes back its own requests alone, and the agreement on each step's tokens still holds (a rank
    that takes back all it can still runs its step, or the empty batch). The tokens are one device's."""
    with over_ranks(tp_size=2, dp_attention=dp, overlap=overlap, page_size=4, max_running=8, new_token_ratio=RATIO,
                    hazard_check=True, num_pages=worst_case_pages(PROMPTS, GREEDY.max_tokens, 4) // 4 + 1) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        traces = llm.rank_traces()
        llm.check_integrity()
    assert [o.token_ids for o in outs] == reference(overlap=overlap)
    taken = [[u for e in trace if e.kind == "retract" for u in e.uids] for trace in traces]
    assert any(taken), "no rank took a request back: the test proves nothing"
    if not dp:
        assert taken[0] == taken[1], "tensor-parallel ranks took back different requests"
