"""Chapter 20: an engine over several ranks, one process and one scheduler each, on a CPU with gloo. Every rank
takes rank 0's inbox before each iteration, so all make the same decisions: the greedy tokens equal one
device's in both loops, with the prefix cache and chunked prefill, the n-gram drafter and grammars, seeded
sampling too, with the hazard checker on every rank; a stream left early and an abort reach every rank, and
the next run is as a fresh engine's; a rank that raises or dies, or ranks that sample apart, end the engine
with RankFailed and leave no process; the options and the command line."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
from dataclasses import replace

import jsonschema
import pytest

from conftest import assert_no_rank_left, no_hang, over_ranks
from minioverlap import LLM, SamplingParams
from minioverlap.cli import engine_options, parser
from minioverlap.constrained.grammar import GrammarBackend
from minioverlap import ranks as ranks_module
from minioverlap.ranks import RankFailed, Ranks, shared

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("one_thread")]

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", [5, 6, 7], "import os\n" * 12,
           "x = [1, 2, 3]\nprint(x)\n" * 3]
PARAMS = [SamplingParams(max_tokens=n) for n in (24, 16, 1, 20, 12)]
OPTIONS = dict(max_running=3, chunked_prefill_size=16)     # requests queue; the long prompts run in chunks
SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}}}
RUN_S = 120                                                # no run of these tests may take longer


def tokens_of(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    with no_hang(RUN_S):
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def one_device() -> list[list[int]]:
    return tokens_of(LLM(overlap=False, **OPTIONS))


@pytest.fixture(scope="module", params=["normal", "overlap"])
def tp2(request):
    """Two ranks, the hazard checker on each (a race on a rank other than 0 would end it: RankFailed)."""
    with over_ranks(tp_size=2, overlap=request.param == "overlap", hazard_check=True, **OPTIONS) as llm:
        yield llm


def test_greedy_tokens_equal_one_device(tp2, one_device):
    """Twice (the second run's prompts hit the prefix cache on every rank): the tokens are one device's."""
    assert tokens_of(tp2) == one_device
    assert tokens_of(tp2) == one_device
    tp2.check_integrity()


def test_seeded_sampling_equals_one_device(tp2):
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in (1, 2)]
    want = tokens_of(LLM(overlap=False, **OPTIONS), PROMPTS[:2], params)
    assert tokens_of(tp2, PROMPTS[:2], params) == want


def test_unseeded_sampling_stays_in_step_whatever_rank_0_s_process_draws(tp2):
    """Unseeded sampled requests, after rank 0's caller has moved its process's generator, at a temperature
    that flattens the distribution and with half the vocabulary as stop tokens (each token stops its request
    about half the time): a rank that sampled another token would end a request at another step,
    and its next batch (and all-reduce) would part from rank 0's. Rank 0 seeds each such request, so the
    runs complete, every request ending on a stop token or its length, and the account holds."""
    import torch
    params = SamplingParams(max_tokens=12, temperature=3.0, stop_token_ids=tuple(range(2048)))
    for _ in range(2):
        torch.rand(7)
        with no_hang(RUN_S):
            outs = tp2.generate(PROMPTS, params)
        assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in outs)
    tp2.check_integrity()


def test_a_stream_left_early_and_an_abort_reach_every_rank(tp2, one_device):
    """A stream is left after its first replies (rank 0 abandons the run, and tells the ranks in the inbox
    they wait for); another stream's request is aborted mid-run. Then the engine gives one device's tokens."""
    with no_hang(RUN_S):
        for reply in tp2.stream(PROMPTS, PARAMS):
            if reply.uid == tp2.next_uid - 5 and reply.token_ids:
                break
        replies = []
        for reply in tp2.stream(PROMPTS[:2], PARAMS[:2]):
            replies.append(reply)
            if len(replies) == 2:
                tp2.abort(reply.uid)
    assert replies[-1].finish_reason == "abort" or any(r.finish_reason == "abort" for r in replies)
    tp2.check_integrity()
    assert tokens_of(tp2) == one_device


def test_the_n_gram_drafter_and_grammars_over_two_ranks():
    """Each rank looks up the same drafts and compiles its own matchers: the tokens are one device's."""
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=48, json_schema=SCHEMA)]
    prompts = PROMPTS[4:5] + PROMPTS[:1]
    want = tokens_of(LLM(overlap=False), prompts, params)
    llm = LLM(tp_size=2, ngram_steps=3)
    procs = list(llm.ranks.procs)
    try:
        with no_hang(RUN_S):
            outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want and outs[0].verify_steps < len(outs[0].token_ids)
        jsonschema.validate(json.loads(outs[1].text), SCHEMA)
    finally:
        llm.shutdown()
    assert_no_rank_left(llm, procs)


def test_a_grammar_rank_0_still_compiles_is_admitted_on_every_rank_at_one_step(monkeypatch):
    """Rank 0's compile is held at a gate, the other rank's is not: that rank admits the request only when
    rank 0 announces its compile done (else the ranks' schedulers part: RankFailed). The plain request runs
    to its end meanwhile, and the tokens are one device's."""
    params = [SamplingParams(max_tokens=48, json_schema=SCHEMA), SamplingParams(max_tokens=12)]
    prompts = PROMPTS[:2]
    want = tokens_of(LLM(overlap=False), prompts, params)
    gate, compile_ = threading.Event(), GrammarBackend.compile

    def held(backend, kind, source):             # rank 0's only: the other rank is a process of its own
        gate.wait(RUN_S / 2)
        return compile_(backend, kind, source)
    monkeypatch.setattr(GrammarBackend, "compile", held)
    llm = LLM(tp_size=2, overlap=True)
    procs = list(llm.ranks.procs)
    try:
        tokens, first = {0: [], 1: []}, llm.next_uid
        with no_hang(RUN_S):
            for reply in llm.stream(prompts, params):
                assert gate.is_set() or reply.uid == first + 1, "the grammar request ran before its compile"
                tokens[reply.uid - first] += reply.token_ids
                if reply.uid == first + 1 and reply.finished:
                    gate.set()
        assert gate.is_set() and [tokens[0], tokens[1]] == want
    finally:
        gate.set()
        llm.shutdown()
    assert_no_rank_left(llm, procs)


def test_four_ranks_give_one_device_s_tokens(one_device):
    """Four ranks: one query head each, the two KV heads copied onto two ranks apiece."""
    llm = LLM(tp_size=4, overlap=True, **OPTIONS)
    procs = list(llm.ranks.procs)
    try:
        assert tokens_of(llm) == one_device
    finally:
        llm.shutdown()
    assert_no_rank_left(llm, procs)


def failing_follow(rank, *args):
    """A rank whose third step raises (a bug on that rank alone): patched into the ranks' processes."""
    from minioverlap.engine.model_runner import ModelRunner
    launch = ModelRunner.launch

    def failing_launch(self, batch, step):
        if step == 3:
            raise RuntimeError(f"rank {rank} fails at step 3 on purpose")
        return launch(self, batch, step)
    ModelRunner.launch = failing_launch
    ranks_module.follow(rank, *args)


def test_a_rank_that_raises_ends_the_engine_with_its_error_and_no_process_left(monkeypatch):
    monkeypatch.setattr(ranks_module, "follow", failing_follow)
    llm = LLM(tp_size=2, overlap=True)
    procs = list(llm.ranks.procs)
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed:.*rank 1 fails at step 3 on purpose"), no_hang(RUN_S):
        llm.generate(PROMPTS[:2], PARAMS[:2])
    assert not [p for p in procs if p.is_alive()]
    llm.shutdown()


class ExitsWhenUnpickled:
    """An option that ends the process which unpickles it: a rank's, as it starts (exit code 3)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_rank_that_dies_as_it_starts_ends_the_start_at_once():
    """A rank whose process ends before it joins the group (here as it reads its arguments; an import or a
    device that fails would do the same) fails the start at once with RankFailed naming it, not after the
    join's deadline (JOIN_TIMEOUT_S, 300 s), and leaves no rank process."""
    before = set(multiprocessing.active_children())        # other tests' engines may hold ranks of their own
    with pytest.raises(RankFailed, match=r"rank 1 died \(exit code 3\)"), no_hang(60):
        Ranks("tiny", {"unreadable": ExitsWhenUnpickled()}, 2, "cpu", 60.0)
    assert not [p for p in set(multiprocessing.active_children()) - before if p.name.startswith("minioverlap-rank-")]


def test_a_killed_rank_ends_the_next_run_with_rank_failed_and_no_process_left():
    kill_rank_1_between_runs(overlap=False)


def kill_rank_1_between_runs(**options) -> None:
    """Two ranks run two requests; rank 1 is killed; the next run raises RankFailed with its exit code and
    leaves no rank process."""
    llm = LLM(tp_size=2, **options)
    procs = list(llm.ranks.procs)
    tokens_of(llm, PROMPTS[:2], PARAMS[:2])
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(30)
    with pytest.raises(RankFailed, match=r"rank 1 died \(exit code -9\)"), no_hang(RUN_S):
        llm.generate(PROMPTS[:2], PARAMS[:2])
    assert not [p for p in procs if p.is_alive()]
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_ranks_that_sample_apart_end_the_run_with_rank_failed_before_their_batches_part(monkeypatch, overlap):
    """Rank 1's copies of the requests cross with another seed: it samples other tokens, and the
    fingerprints compared after the next exchange differ. Every rank learns it there, before any collective
    of a batch that would no longer pair (gloo would abort a process), and the engine ends with RankFailed
    naming the rank, no process left."""
    def shared_with_other_seeds(items):
        return [(kind, replace(item, params=replace(item.params, seed=item.params.seed + 1)) if kind == "add" else item)
                for kind, item in shared(items)]
    monkeypatch.setattr(ranks_module, "shared", shared_with_other_seeds)
    llm = LLM(tp_size=2, overlap=overlap)
    procs = list(llm.ranks.procs)
    params = SamplingParams(max_tokens=12, temperature=3.0, seed=7, stop_token_ids=tuple(range(2048)))
    with pytest.raises(RankFailed, match=r"rank 1's scheduler has parted from rank 0's"), no_hang(RUN_S):
        llm.generate(PROMPTS, params)
    assert not [p for p in procs if p.is_alive()]
    llm.shutdown()


@pytest.mark.parametrize("options,message", [
    (dict(tp_size=3), r"tp_size \(3\) must divide num_attention_heads \(4\)"),
    (dict(tp_size=0), r"tp_size must be an integer in \[1, 8\], got 0"),
    (dict(tp_size=2, kernels=True), r"tp_size=2 with kernels=True: tensor parallelism runs the reference path"),
], ids=["heads", "zero", "kernels"])
def test_options_are_refused_before_any_rank_starts(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(**options)


@pytest.mark.parametrize("command", [["generate", "hello"], ["trace"], ["serve"]])
def test_the_command_line_passes_tp(command):
    assert engine_options(parser().parse_args([*command, "--tp", "2"]))["tp_size"] == 2
    assert "tp_size" not in engine_options(parser().parse_args(command))


def test_a_server_over_two_ranks_serves_one_device_s_text():
    """`minioverlap serve --tp 2`: the scheduler process is rank 0 and starts rank 1; a completion's text is
    one device's, the integrity report clean once idle, and the server stops with no rank left."""
    import openai

    from tests.serving import Server
    want = LLM(overlap=False).generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    server = Server("--tp", "2", "--max-running", "4")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60.0)
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
        report = server.wait_idle()
        assert report["idle"] and report["problems"] is None
    finally:
        code, output = server.stop()
    assert code == 0, output


DEADLINE_S = 5.0     # a collective's deadline in the idle tests (dist_timeout); the ranks idle longer than it
IDLE_S = 8.0


@pytest.mark.parametrize("dp_attention", [False, True], ids=["tp", "dp-attention"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_ranks_idle_past_a_collective_s_deadline_then_give_one_device_s_tokens(overlap, dp_attention, one_device):
    """Only rank 0 knows when work comes, so between runs the other ranks wait for its next inbox with no
    deadline. With a collective's deadline of 5 s the ranks idle 8 s between two runs, and the second run's
    tokens are still one device's (a wait with the deadline ends rank 1 there: the second run raises
    RankFailed). A stuck peer inside a step is still a timeout; a dead one is found at once (below)."""
    import time
    llm = LLM(tp_size=2, overlap=overlap, dp_attention=dp_attention, dist_timeout=DEADLINE_S, **OPTIONS)
    procs = list(llm.ranks.procs)
    try:
        assert tokens_of(llm) == one_device
        time.sleep(IDLE_S)
        assert tokens_of(llm) == one_device
    finally:
        llm.shutdown()
    assert_no_rank_left(llm, procs)


def rank_processes(server_pid: int) -> list[int]:
    """The pids of a server's ranks 1..N-1: spawned by its scheduler process (rank 0), a child of the server."""
    def children(pid: int) -> list[int]:
        path = f"/proc/{pid}/task/{pid}/children"
        return [int(p) for p in open(path).read().split()] if os.path.exists(path) else []

    def cmdline(pid: int) -> str:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    return [pid for child in children(server_pid) for pid in children(child)
            if "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the rank's process through /proc (Linux)")
def test_an_idle_server_over_two_ranks_serves_after_the_deadline_and_reports_a_dead_rank_at_once():
    """`minioverlap serve --tp 2 --dist-timeout 5`: a completion, 8 s idle, the same completion (the ranks
    waited for work without a deadline); then rank 1 is killed while the server idles, and /health answers
    503 naming the dead rank within seconds, not at the next request."""
    import time

    import httpx

    from tests.serving import Server
    server = Server("--tp", "2", "--dist-timeout", str(DEADLINE_S))
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    try:
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0).json()["choices"][0]["text"]
        time.sleep(IDLE_S)
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0).json()["choices"][0]["text"]
        assert again == first
        server.wait_idle()
        time.sleep(1.0)           # the run that served it ends with one more agreement, a collective, after its reply
        [rank_1] = rank_processes(server.process.pid)
        os.kill(rank_1, signal.SIGKILL)
        deadline = time.monotonic() + 15.0
        while (health := httpx.get(f"{server.url}/health", timeout=5.0)).status_code == 200:
            assert time.monotonic() < deadline, "/health still says ok 15 s after rank 1 died"
            time.sleep(0.2)
        assert health.status_code == 503 and "rank 1 died" in health.json()["status"], health.text
    finally:
        server.stop()
