"""Chapter 18: chunked prefill and mixed steps. Tokens equal whole-prompt prefill (both loops x chunk
sizes 1, 7, 16 and none x mixed on and off x MTP off and k=3 x the prefix cache on and off); the exact
order of a long prompt's chunks among running streams; aborts between chunks and with a chunk in flight;
a chunked request whose prefix is cached; the hazard checker silent and the account of every page and
slot holding after every run."""

from __future__ import annotations

import itertools

import pytest
import torch

from minioverlap import LLM, SamplingParams
from minioverlap.cli import engine_options, parser
from minioverlap.config import EngineArgs, Guards, chunk_size
from minioverlap.engine.forward_batch import ForwardMode

from conftest import sampled

SYSTEM = list(range(100, 140))                       # a 40-token "system prompt"
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Long and short prompts, two sharing the system prompt: with chunks of 7 a long one takes six steps."""
    return [SYSTEM + [7, 8, 9], [5, 6], SYSTEM + [11] * 5, list(range(300, 317)), [42]]


@pytest.fixture(scope="module")
def whole() -> dict:
    """Whole-prompt prefill, normal loop, no cache: each MTP setting's tokens, once."""
    return {}


def baseline(cache: dict, mtp: int) -> list[list[int]]:
    if mtp not in cache:
        llm = LLM(page_size=4, overlap=False, mtp_steps=mtp, prefix_cache=False, chunked_prefill_size=-1)
        cache[mtp] = [o.token_ids for o in llm.generate(prompts(), PARAMS)]
    return cache[mtp]


GRID = [(size, mixed, mtp, cache) for size, mixed, mtp, cache in itertools.product((1, 7, 16, -1), (False, True), (0, 3),
                                                                                     (True, False)) if not (mixed and mtp)]


@pytest.mark.parametrize("size,mixed,mtp,cache", sampled(GRID, [(7, True, 0, True), (16, False, 3, False)]))
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_tokens_equal_whole_prompt_prefill(whole, overlap, size, mixed, mtp, cache):
    """Every prompt's tokens equal whole-prompt prefill's, in a first run and in a second one (which, with
    the cache, starts every prompt after its cached prefix and chunks the rest); no hazard; the account
    holds after each run."""
    llm = LLM(page_size=4, overlap=overlap, chunked_prefill_size=size, mixed_chunk=mixed, mtp_steps=mtp,
              prefix_cache=cache, hazard_check=True)
    for run in range(2):
        outs = llm.generate(prompts(), PARAMS)
        assert [o.token_ids for o in outs] == baseline(whole, mtp), f"run {run + 1}"
        llm.check_integrity()
    assert any(o.cached_tokens for o in outs) == cache


SEEDED = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(5)]


@pytest.mark.parametrize("size,mixed,mtp", [(1, False, 0), (7, True, 0), (16, False, 3)], ids=["1", "7-mixed", "16-mtp"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_seeded_request_s_tokens_do_not_depend_on_its_chunks(overlap, size, mixed, mtp):
    """A chunk's token is thrown away, so it draws nothing from its request's generator: the seeded tokens
    equal whole-prompt prefill's, in a first run and in a second whose prompts start after a cached prefix
    (fewer chunks)."""
    want = [o.token_ids for o in LLM(page_size=4, overlap=False, mtp_steps=mtp, prefix_cache=False,
                                     chunked_prefill_size=-1).generate(prompts(), SEEDED)]
    llm = LLM(page_size=4, overlap=overlap, chunked_prefill_size=size, mixed_chunk=mixed, mtp_steps=mtp)
    for run in range(2):
        assert [o.token_ids for o in llm.generate(prompts(), SEEDED)] == want, f"run {run + 1}"


def steps(llm: LLM) -> list[tuple[int, tuple, tuple, tuple]]:
    """The run's steps as (N, the requests it ran, those whose rows were a chunk, the replies of its handling)."""
    kinds = {kind: {e.step: e.uids for e in llm.trace if e.kind == kind} for kind in ("schedule", "chunk", "reply")}
    return [(n, uids, kinds["chunk"].get(n, ()), kinds["reply"].get(n, ())) for n, uids in kinds["schedule"].items()]


def long_prompt_among_streams(overlap: bool, mixed: bool) -> LLM:
    """Two short requests stream; at their first reply a 30-token prompt arrives, in chunks of 8 tokens a step."""
    llm = LLM(overlap=overlap, chunked_prefill_size=8, mixed_chunk=mixed, hazard_check=True)
    for reply in llm.stream([[5, 6], [7, 8]], SamplingParams(max_tokens=9, ignore_eos=True)):
        if reply.uid == 0 and len(reply.token_ids) == 1 and llm.next_uid == 2:
            llm.add_request(list(range(200, 230)), SamplingParams(max_tokens=2, ignore_eos=True))
    llm.check_integrity()
    return llm


def test_a_long_prompt_among_streams_waits_without_mixing():
    """Without mixing a chunk step is a prefill step: the streams wait for every chunk (SGLang's order),
    and the long prompt replies nothing until its last chunk."""
    llm = long_prompt_among_streams(overlap=False, mixed=False)
    assert steps(llm)[:7] == [
        (1, (0, 1), (), (0, 1)),
        (2, (2,), (2,), ()), (3, (2,), (2,), ()), (4, (2,), (2,), ()),     # 8 + 8 + 8 tokens: chunks
        (5, (2,), (), (2,)),                                               # the last 6: its first token
        (6, (0, 1, 2), (), (0, 1, 2)),                                     # the streams go on
        (7, (0, 1), (), (0, 1)),                                           # its 2 tokens are out
    ]


def test_a_long_prompt_among_streams_rides_with_their_decode_rows_when_mixed():
    """With mixing every chunk step carries the streams' decode rows, after the chunk, in the same budget of 8
    (6 prompt tokens a step): no stream misses a step."""
    llm = long_prompt_among_streams(overlap=False, mixed=True)
    assert steps(llm)[:7] == [
        (1, (0, 1), (), (0, 1)),
        (2, (2, 0, 1), (2,), (0, 1)), (3, (2, 0, 1), (2,), (0, 1)), (4, (2, 0, 1), (2,), (0, 1)),
        (5, (2, 0, 1), (2,), (0, 1)),                                      # 6 + 6 + 6 + 6 tokens: chunks
        (6, (2, 0, 1), (), (2, 0, 1)),                                     # the last 6: its first token
        (7, (0, 1, 2), (), (0, 1, 2)),
    ]


def test_in_the_overlap_loop_a_mixed_step_is_launched_before_the_last_one_is_handled():
    """The same run in the overlap loop: step N+1 (a chunk and the decode rows) is launched before step N is
    handled, so the decode rows' inputs are tokens the host has not seen yet: they are read on the device
    (SGLang #2158). The long prompt arrives one step later (its receive follows a reply one step late)."""
    llm = long_prompt_among_streams(overlap=True, mixed=True)
    order = llm.trace.order(("launch", "process", "chunk"))
    assert order[:12] == ["launch 1", "launch 2", "handle 1", "chunk 3", "launch 3", "handle 2",
                          "chunk 4", "launch 4", "handle 3", "chunk 5", "launch 5", "handle 4"]
    assert steps(llm)[1:4] == [(2, (0, 1), (), (0, 1)), (3, (2, 0, 1), (2,), (0, 1)), (4, (2, 0, 1), (2,), (0, 1))]


def test_first_tokens_first_waits_for_the_last_chunk_only():
    """The overlap loop's first_tokens_first (chapter 16) handles a step before the next launch only where
    the step gives first tokens: a prompt of 20 tokens in chunks of 8 overlaps its two chunks (nothing to
    hand out), and waits for the third, its last."""
    llm = LLM(overlap=True, chunked_prefill_size=8)
    llm.scheduler.submit(llm.make_requests([list(range(200, 220))], SamplingParams(max_tokens=3, ignore_eos=True)))
    list(llm.scheduler.run(overlap=True, first_tokens_first=True))
    assert llm.trace.order(("launch", "process")) == ["launch 1", "launch 2", "handle 1", "launch 3", "handle 2",
                                                      "handle 3", "launch 4", "launch 5", "handle 4", "handle 5"]


def abort_after_two_chunks(overlap: bool, mtp: int) -> LLM:
    """Stream a long prompt (six chunks of 7) and a short one, and abort the long one as its second chunk
    is launched. The abort is received at the next iteration: in the normal loop after that chunk is
    handled (between chunks), in the overlap loop before it is (the chunk in flight); no third is launched."""
    llm = LLM(page_size=4, overlap=overlap, mtp_steps=mtp, chunked_prefill_size=7, hazard_check=True)
    launch, chunk_steps = llm.scheduler.launch, []

    def launch_then_abort(batch):
        out = launch(batch)
        if 0 in [r.uid for r, chunk in zip(batch.reqs, batch.chunks()) if chunk]:
            chunk_steps.append(out.step)
            if len(chunk_steps) == 2:
                llm.abort(0)
        return out

    llm.scheduler.launch = launch_then_abort
    replies = list(llm.stream([SYSTEM + [1, 2], [5, 6]], PARAMS))
    llm.scheduler.launch = launch
    assert [r.finish_reason for r in replies if r.uid == 0] == ["abort"], "a chunk replied"
    assert len(chunk_steps) == 2
    return llm


@pytest.mark.parametrize("overlap", [False, True], ids=["between", "in-flight"])
@pytest.mark.parametrize("mtp", [0, 3])
def test_an_abort_between_chunks_or_with_one_in_flight_frees_everything_once(overlap, mtp):
    """Every page and slot free once, no lock left, and the engine then serves the same prompts as a fresh one."""
    llm = abort_after_two_chunks(overlap, mtp)
    llm.check_integrity()
    assert all(n.lock == 0 for n in llm.runner.cache.tree.nodes()), "a lock outlived its request"
    assert llm.runner.free_pages == llm.runner.usable_pages
    fresh = LLM(page_size=4, overlap=overlap, mtp_steps=mtp, prefix_cache=False, chunked_prefill_size=-1)
    again = [SYSTEM + [1, 2], [5, 6]]
    assert [o.token_ids for o in llm.generate(again, PARAMS)] == [o.token_ids for o in fresh.generate(again, PARAMS)]
    llm.check_integrity()


def test_an_abort_while_queued_behind_a_chunked_prompt_frees_nothing_it_never_had():
    llm = LLM(page_size=4, chunked_prefill_size=7, max_running=1, hazard_check=True)
    stream = llm.stream([SYSTEM + [1, 2], SYSTEM + [3]], PARAMS)
    llm.abort(1)
    replies = list(stream)
    assert [r.finish_reason for r in replies if r.uid == 1] == ["abort"]
    llm.check_integrity()
    assert llm.runner.free_pages == llm.runner.usable_pages


def test_handled_chunks_enter_the_prefix_cache():
    """A chunk's K and V enter the tree when the chunk is handled, in whole pages: an abort after two
    chunks of 7 (14 tokens) leaves 12 tokens cached (3 pages of 4), which the next request with that prompt
    starts from."""
    llm = abort_after_two_chunks(overlap=False, mtp=0)
    [out] = llm.generate([SYSTEM + [1, 2]], PARAMS)
    assert out.cached_tokens == 12


def test_a_chunked_request_whose_prefix_is_cached_chunks_the_rest():
    """Its prefill starts after the cached prefix: chunks of 7 from there, the trace shows the hit, then
    the chunks; its tokens equal whole-prompt prefill's."""
    llm = LLM(page_size=4, chunked_prefill_size=7, overlap=False)
    llm.generate([SYSTEM + [1, 2]], PARAMS)
    batches = []
    runner_batch = llm.runner.batch
    llm.runner.batch = lambda mode, reqs: batches.append(runner_batch(mode, reqs)) or batches[-1]
    [out] = llm.generate([SYSTEM + [3] * 20], PARAMS)
    assert out.cached_tokens == 40
    prefills = [b for b in batches if b.mode is ForwardMode.EXTEND]
    assert [(b.prefix_lens, b.extend_lens) for b in prefills] == [([40], [7]), ([47], [7]), ([54], [6])]
    assert [e.kind for e in llm.trace if e.step == 1][:3] == ["hit", "schedule", "chunk"]
    want = LLM(page_size=4, prefix_cache=False, chunked_prefill_size=-1).generate([SYSTEM + [3] * 20], PARAMS)
    assert out.token_ids == want[0].token_ids


def drafter_keys(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The drafter's K of the prompt's positions, read through its request's row as its first reply arrives."""
    for reply in llm.stream([prompt], SamplingParams(max_tokens=4, ignore_eos=True)):
        req = llm.scheduler.running[0]
        slots = llm.runner.tables.slots_of(req.row, len(prompt))
        keys = llm.runner.draft_kv_pool.k[0][slots].clone()
        llm.abort(reply.uid)
        return keys
    raise AssertionError("no reply")


def test_the_drafter_k_of_a_chunked_prompt_equals_a_whole_prompts():
    """With MTP the drafter's row at a chunk's last position reads the prompt's next token (the host knows
    it), as a whole prompt's row does: its K and V are the same at every position, so a prefix cached from
    chunks is as good for drafting as one cached whole."""
    prompt = SYSTEM + [3] * 9
    chunked = drafter_keys(LLM(page_size=4, mtp_steps=3, chunked_prefill_size=7), prompt)
    whole_k = drafter_keys(LLM(page_size=4, mtp_steps=3, chunked_prefill_size=-1), prompt)
    assert torch.allclose(chunked, whole_k, atol=1e-4), (chunked - whole_k).abs().amax(dim=(1, 2))


def test_a_chunk_replies_nothing_and_the_first_token_comes_after_the_last_chunk():
    llm = LLM(chunked_prefill_size=5)
    replies = list(llm.stream([list(range(200, 223))], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert [len(r.token_ids) for r in replies] == [1, 1, 1]
    assert [(e.kind, e.step) for e in llm.trace if e.kind in ("chunk", "reply") and e.uids] == [
        ("chunk", 1), ("chunk", 2), ("chunk", 3), ("chunk", 4), ("reply", 5), ("reply", 6), ("reply", 7)]


# ---- the options
def test_the_budget_defaults_to_the_devices_and_minus_one_turns_it_off():
    """64 prompt tokens a step on a CPU, 8192 on a GPU (SGLang's on an H100 or H200): both from the options
    alone, and in an engine on the device the suite runs on (MINIOVERLAP_TEST_DEVICE)."""
    assert [chunk_size(EngineArgs(device=d)) for d in ("cpu", "cuda", "cuda:1")] == [64, 8192, 8192]
    llm = LLM()
    assert llm.scheduler.chunked_prefill_size == {"cpu": 64, "cuda": 8192}[llm.runner.device.type]
    assert LLM(chunked_prefill_size=-1).scheduler.chunked_prefill_size is None
    assert LLM(chunked_prefill_size=7).scheduler.chunked_prefill_size == 7
    assert LLM(guards=Guards(prompt_on_forward_stream=False)).scheduler.chunked_prefill_size is None, \
        "with chapter 08's prompt written at admission the default is whole prompts"


@pytest.mark.parametrize("options,message", [
    ({"chunked_prefill_size": 0}, r"chunked_prefill_size must be an integer >= 1, or -1 \(every prompt whole\), got 0"),
    ({"chunked_prefill_size": True}, "chunked_prefill_size must be an integer >= 1, or -1"),
    ({"chunked_prefill_size": 7.5}, "chunked_prefill_size must be an integer"),
    ({"mixed_chunk": 1}, "mixed_chunk must be True or False, got 1"),
    ({"mixed_chunk": True, "mtp_steps": 3}, "mixed_chunk=True with mtp_steps=3: a verify step runs a window of 4 tokens"),
    ({"chunked_prefill_size": 16, "guards": Guards(prompt_on_forward_stream=False)},
     r"chunked_prefill_size=16 needs Guards\(prompt_on_forward_stream=True\)"),
])
def test_a_bad_option_is_refused_with_its_name_value_and_limit(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(**options)


def test_the_command_line_passes_the_budget_and_mixing():
    args = parser().parse_args(["serve", "--chunked-prefill-size", "512", "--enable-mixed-chunk"])
    assert engine_options(args) | {"model": "tiny"} == {"model": "tiny", "device": "cpu", "chunked_prefill_size": 512,
                                                        "mixed_chunk": True}
    args = parser().parse_args(["generate", "hello", "--chunked-prefill-size", "-1"])
    assert engine_options(args)["chunked_prefill_size"] == -1


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_fast_path_runs_chunks_and_mixed_steps_as_the_reference_does(overlap):
    """On the fast path (its kernels in Triton's interpreter without a GPU) a mixed step is one extend
    kernel a layer over the chunks and the one-token decode rows: the reference path's tokens. Chunks of
    16: the long prompts (43 and 45 tokens) take three steps each, mixed with the short ones' decode rows."""
    pytest.importorskip("triton")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(page_size=4, overlap=overlap, chunked_prefill_size=16, mixed_chunk=True, kernels=True, hazard_check=True)
    outs = llm.generate(prompts(), params)
    reference = LLM(page_size=4, overlap=False, chunked_prefill_size=-1, prefix_cache=False).generate(prompts(), params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    llm.check_integrity()


# ---- the server
@pytest.mark.process
def test_a_server_that_chunks_and_mixes_serves_what_whole_prompts_give():
    """`minioverlap serve --chunked-prefill-size 16 --enable-mixed-chunk`, as an OpenAI client uses it: a
    long prompt's completion (210 tokens, in chunks) while a stream runs, the same prompt streamed and
    left after its first token, the first stream left before its end: the text is whole-prompt
    prefill's, and once idle every page and slot is free."""
    import openai
    from tests.serving import Server

    long_prompt = "def fibonacci(n):\n" + "    x = [1, 2, 3]\n" * 20
    server = Server("--chunked-prefill-size", "16", "--enable-mixed-chunk")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="class Stack:", max_tokens=64, temperature=0,
                                           stream=True)
        next(iter(stream))                                   # a stream runs ...
        long = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8, temperature=0)
        left = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8, temperature=0, stream=True)
        next(iter(left))
        left.close()                                         # ... and one leaves early
        stream.close()
        report = server.wait_idle()
        assert report["problems"] is None, report
    finally:
        code, out = server.stop()
    assert code == 0, out
    want = LLM(chunked_prefill_size=-1).generate([long_prompt], SamplingParams(max_tokens=8))[0]
    assert long.choices[0].text == want.text
