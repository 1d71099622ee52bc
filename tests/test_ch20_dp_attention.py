"""Chapter 20: DP attention over two ranks on a CPU with gloo. Each rank serves its own requests (the least
loaded first) and runs attention alone; before every step the ranks agree on it, and a rank with nothing to
run runs the empty batch. The greedy tokens equal one device's in both loops, with the prefix cache, chunked
prefill, grammars and seeded sampling, MTP and the n-gram drafter, with one rank idle and with one rank prefilling while the other
decodes, and `hazard_check=True` on every rank; a stream left early and an abort reach the rank that holds
the request, and the next run is as a fresh engine's; a killed rank ends the engine with RankFailed and no
process left; four DP ranks; a server over two DP ranks; the options and the command line."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import no_hang, over_ranks
from minioverlap import LLM, SamplingParams
from minioverlap.cli import engine_options, parser
from minioverlap.parallel.dp_scheduler import assign
from test_ch20_ranks import (OPTIONS, PARAMS, PROMPTS, RUN_S, SCHEMA,  # the same requests as tensor parallelism's
                             kill_rank_1_between_runs, tokens_of)

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("one_thread")]


def events(trace, kind: str) -> list:
    return [e for e in trace if e.kind == kind]


@pytest.fixture(scope="module")
def one_device() -> list[list[int]]:
    return tokens_of(LLM(overlap=False, **OPTIONS))


STUCK_S = 15.0    # a collective's deadline here (dist_timeout): a rank that skips a collective fails the run in
                  # seconds, not after the default minute


@pytest.fixture(scope="module", params=["normal", "overlap"])
def dp2(request):
    """Two DP-attention ranks, the hazard checker on each."""
    overlap = request.param == "overlap"
    with over_ranks(tp_size=2, dp_attention=True, overlap=overlap, hazard_check=True, dist_timeout=STUCK_S,
                    **OPTIONS) as llm:
        yield llm


def test_greedy_tokens_equal_one_device(dp2, one_device):
    """Twice (the second run's prompts hit each rank's own prefix cache): the tokens are one device's, and
    both ranks served requests: rank 0 three, rank 1 two (each new request to the less loaded)."""
    assert tokens_of(dp2) == one_device
    assert tokens_of(dp2) == one_device
    rank0, rank1 = dp2.rank_traces()
    served = [{u for e in events(t, "launch") for u in e.uids} for t in (rank0, rank1)]
    assert [len(s) for s in served] == [3, 2] and not served[0] & served[1]
    dp2.check_integrity()


def test_rank_0_reports_another_rank_s_cached_tokens_from_its_replies(dp2):
    """Rank 0 knows the requests another rank serves by their replies alone, which carry what its
    callers' outputs report (describe): the prompt tokens each rank's prefix cache served equal one
    device's, the second time the prompts come, rank 1's requests included."""
    one = LLM(overlap=False, **OPTIONS)
    with no_hang(RUN_S):
        for llm in (one, dp2):
            llm.generate(PROMPTS, PARAMS)
        want, outs = ([o.cached_tokens for o in llm.generate(PROMPTS, PARAMS)] for llm in (one, dp2))
    assert outs == want and want[3] > 0, "the fourth request (rank 1's) is served from the cache"


def test_an_idle_rank_runs_the_empty_batch_in_every_step(dp2, one_device):
    """One request: rank 1 has nothing, and runs the empty batch in each of the steps rank 0 runs."""
    assert tokens_of(dp2, PROMPTS[:1], PARAMS[:1]) == one_device[:1]
    rank0, rank1 = dp2.rank_traces()
    steps = [e.step for e in events(rank0, "launch")]
    assert len(steps) == 1 + 23 and not events(rank1, "launch")
    assert [e.step for e in events(rank1, "idle")] == steps
    assert [e.uids for e in events(rank1, "agree")] == [e.uids for e in events(rank0, "agree")]


def test_one_rank_prefills_while_the_other_decodes(dp2, one_device):
    """A request joins the run while rank 0 decodes: it goes to rank 1, the less loaded, whose prefill is
    agreed with rank 0's decode step (counts 1 and the prompt's tokens not in rank 1's prefix cache). The
    tokens are one device's."""
    with no_hang(RUN_S):
        stream = dp2.stream(PROMPTS[:1], PARAMS[:1])
        replies = [next(stream), next(stream)]
        late = dp2.add_request(PROMPTS[3], PARAMS[3])
        replies += list(stream)
    tokens = {uid: [t for r in replies if r.uid == uid for t in r.token_ids] for uid in (late - 1, late)}
    assert [tokens[late - 1], tokens[late]] == [one_device[0], one_device[3]]
    rank0, rank1 = dp2.rank_traces()
    counts = [e.uids for e in events(rank0, "agree")]
    assert any(ours == 1 and theirs > 1 for ours, theirs in counts), \
        f"a step where rank 0 decodes one row while rank 1 prefills: {counts}"
    assert {u for e in events(rank1, "launch") for u in e.uids} == {late}


def test_grammars_and_seeded_sampling_equal_one_device(dp2):
    params = [SamplingParams(max_tokens=48, json_schema=SCHEMA), SamplingParams(max_tokens=16, temperature=0.8, seed=3),
              SamplingParams(max_tokens=16, temperature=0.8, seed=4)]
    want = LLM(overlap=False).generate(PROMPTS[:3], params)
    with no_hang(RUN_S):
        outs = dp2.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)


def test_four_dp_ranks_give_one_device_s_tokens(one_device):
    """Four ranks, five requests arriving at once: one to each rank, the fifth to rank 0 (ties go to the
    lowest rank). The tokens are one device's."""
    llm = LLM(tp_size=4, dp_attention=True, overlap=True, **OPTIONS)
    try:
        assert tokens_of(llm) == one_device
        served = [{u for e in events(trace, "launch") for u in e.uids} for trace in llm.rank_traces()]
        assert [len(s) for s in served] == [2, 1, 1, 1]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("drafter", [dict(mtp_steps=3), dict(ngram_steps=3)], ids=["mtp3", "ngram3"])
def test_drafters_give_one_device_s_tokens_and_verify_steps(drafter, overlap):
    """MTP's layer whole on every rank, or the n-gram lookup, each rank drafting for its own requests; with
    a grammar on rank 1's request (with MTP, in the overlap loop, its verify puts its accept off; with the
    n-gram drafter a rank with a step in flight handles it before it builds the next, so every rank does,
    agreed at the iteration's start, an idle rank too). Tokens and verify steps: one device's, and every
    rank agreed on the same steps with the same counts."""
    params = [SamplingParams(max_tokens=n) for n in (24, 16, 1, 20, 12)]
    params[1] = SamplingParams(max_tokens=40, json_schema=SCHEMA)
    want = LLM(overlap=False, **OPTIONS, **drafter).generate(PROMPTS, params)
    llm = LLM(tp_size=2, dp_attention=True, overlap=overlap, hazard_check=True, **OPTIONS, **drafter)
    try:
        with no_hang(RUN_S):
            outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert [o.verify_steps for o in outs] == [o.verify_steps for o in want]
        jsonschema.validate(json.loads(outs[1].text), SCHEMA)
        agreed = [[(e.step, e.uids) for e in events(trace, "agree")] for trace in llm.rank_traces()]
        assert agreed[0] and agreed[0] == agreed[1]
    finally:
        llm.shutdown()


def test_with_the_n_gram_drafter_an_idle_rank_handles_first_with_the_busy_one():
    """The overlap loop with the n-gram drafter and one request: rank 0 handles each step before it builds
    the next (its lookup needs the tokens), and rank 1, with no step in flight, must take the same path,
    or its agreement pairs with rank 0's replies. One device's tokens; rank 1 idle in each of rank 0's
    steps, with the same agreements."""
    params = SamplingParams(max_tokens=16)
    want = LLM(overlap=False, **OPTIONS, ngram_steps=3).generate(PROMPTS[0], params)[0].token_ids
    llm = LLM(tp_size=2, dp_attention=True, overlap=True, ngram_steps=3, dist_timeout=STUCK_S, **OPTIONS)
    try:
        with no_hang(RUN_S):
            assert llm.generate(PROMPTS[0], params)[0].token_ids == want
        rank0, rank1 = llm.rank_traces()
        assert [e.step for e in events(rank1, "idle")] == [e.step for e in events(rank0, "launch")]
        assert [(e.step, e.uids) for e in events(rank1, "agree")] == [(e.step, e.uids) for e in events(rank0, "agree")]
    finally:
        llm.shutdown()


def test_a_stream_left_early_and_an_abort_reach_the_rank_that_holds_the_request(dp2, one_device):
    """A stream is left after rank 1's request has replied (every rank abandons the run); then a request
    of rank 1 is aborted mid-run. After both the engine gives one device's tokens."""
    with no_hang(RUN_S):
        for reply in dp2.stream(PROMPTS, PARAMS):
            if reply.uid == dp2.next_uid - 4 and reply.token_ids:      # the second request: rank 1's
                break
        replies = []
        for reply in dp2.stream(PROMPTS[:2], PARAMS[:2]):
            replies.append(reply)
            if len(replies) == 2:
                dp2.abort(dp2.next_uid - 1)                           # rank 1's request
    assert [r.finish_reason for r in replies if r.uid == dp2.next_uid - 1][-1] == "abort"
    dp2.check_integrity()
    assert tokens_of(dp2) == one_device


def test_a_killed_rank_ends_the_next_run_with_rank_failed_and_no_process_left():
    kill_rank_1_between_runs(dp_attention=True)


def test_a_server_over_two_dp_ranks_serves_one_device_s_text():
    """`minioverlap serve --tp 2 --dp-attention`: a completion with n=2 makes two requests, one on each rank
    (both texts are one device's: greedy); the integrity report is clean once idle; no rank is left."""
    import openai

    from tests.serving import Server
    want = LLM(overlap=False).generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    server = Server("--tp", "2", "--dp-attention", "--max-running", "4")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60.0)
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, n=2,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in out.choices] == [want, want]
        report = server.wait_idle()
        assert report["idle"] and report["problems"] is None
    finally:
        code, output = server.stop()
    assert code == 0, output


@pytest.mark.parametrize("loads,count,owners", [
    ([0, 0], 5, [0, 1, 0, 1, 0]),
    ([3, 0], 4, [1, 1, 1, 0]),
    ([2, 1, 1, 0], 3, [3, 1, 2]),
])
def test_each_new_request_goes_to_the_least_loaded_rank(loads, count, owners):
    assert assign(count, loads) == owners


@pytest.mark.parametrize("options,message", [
    (dict(dp_attention=True), r"dp_attention=True needs tp_size > 1"),
    (dict(tp_size=5, dp_attention=True), r"tp_size \(5\) must divide intermediate_size"),
    (dict(tp_size=2, dp_attention=1), r"dp_attention must be True or False, got 1"),
])
def test_options_are_refused_before_any_rank_starts(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(**options)


@pytest.mark.parametrize("command", [["generate", "hello"], ["trace"], ["serve"]])
def test_the_command_line_passes_dp_attention(command):
    options = engine_options(parser().parse_args([*command, "--tp", "2", "--dp-attention"]))
    assert options["tp_size"] == 2 and options["dp_attention"] is True
    assert "dp_attention" not in engine_options(parser().parse_args(command))
