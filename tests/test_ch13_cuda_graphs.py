"""Chapter 13: the decode step as one CUDA graph replay, and with MTP the verify step as three. On a CPU:
the buckets, the padding of a batch into its bucket, the switch (None: on for CUDA, off for CPU; True on
a CPU refused), and, with a stand-in for a graph, everything around the replays: tokens equal to eager
ones in both loops with and without MTP, a verify batch padded to its bucket, the checker silent. On a
GPU: the same with real graphs."""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from conftest import no_hang, run_example, sampled
from minioverlap import LLM, SamplingParams
from minioverlap.engine import cuda_graph
from minioverlap.speculative import graphs
from minioverlap.engine.cuda_graph import StaticInputs, bucket_for, graph_buckets
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["def fibonacci(n):", "class Stack:", [5, 6, 7], "import os\n", "    for i in range(10):",
           "def is_prime(n):", [9] * 12]


# ---- on any machine

def test_the_buckets_are_1_2_4_8_then_every_16_and_max_running():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(16) == [1, 2, 4, 8, 16]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 33, 49, 64)] == [1, 2, 4, 8, 8, 16, 32, 48, 64, 64]


def decode_batch(positions, slots, seq_lens) -> ForwardBatch:
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)         # noqa: E731
    B = len(positions)
    return ForwardBatch(ForwardMode.DECODE, [None] * B, positions=t(positions), out_cache_loc=t(slots),
                        req_pool_indices=t(range(B)), seq_lens=t(seq_lens), prefix_lens=[0] * B, extend_lens=[1] * B,
                        rows=list(range(B)), pages=[], last_index=t(range(B)))


def test_a_batch_of_5_is_padded_to_the_bucket_of_8_with_rows_that_touch_only_slot_0():
    """Five rows are copied in; rows 5..7 read token 0 at position 0 with one key visible, write their K
    and V to KV slot 0, and their page table holds KV slot 0 only. Columns past a row's page table keep
    whatever they held (masked: past its length)."""
    inputs = StaticInputs(8, 12, 50, torch.int32, torch.device("cpu"))
    inputs.input_ids.fill_(7), inputs.positions.fill_(7), inputs.out_cache_loc.fill_(7), inputs.seq_lens.fill_(7)
    inputs.page_table.fill_(7)
    batch, input_ids = decode_batch([3, 4, 5, 6, 7], [21, 22, 23, 24, 25], [4, 5, 6, 7, 8]), torch.tensor([11, 12, 13, 14, 15])
    page_table = torch.arange(1, 41, dtype=torch.int32).view(5, 8)
    b = bucket_for(5, graph_buckets(8))
    inputs.load(batch, input_ids, page_table, b)
    assert b == 8
    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 0, 0, 0]
    assert inputs.out_cache_loc.tolist() == [21, 22, 23, 24, 25, 0, 0, 0]
    assert inputs.seq_lens.tolist() == [4, 5, 6, 7, 8, 1, 1, 1]
    assert inputs.page_table[:5, :8].tolist() == page_table.tolist()
    assert inputs.page_table[5:].tolist() == [[0] * 12] * 3
    assert inputs.page_table[:5, 8:].tolist() == [[7] * 4] * 5


def test_a_smaller_batch_later_pads_over_what_a_larger_one_left():
    """Buffers are shared by every bucket: after a batch of 8, a batch of 3 in the bucket of 4 pads row 3
    afresh, and rows 4..7 (outside its bucket) are not read by its graph."""
    inputs = StaticInputs(8, 4, 10, torch.int32, torch.device("cpu"))
    inputs.load(decode_batch([2] * 8, [3] * 8, [4] * 8), torch.tensor([1] * 8), torch.full((8, 4), 9, dtype=torch.int32), 8)
    inputs.load(decode_batch([6, 6, 6], [7, 7, 7], [8, 8, 8]), torch.tensor([5, 5, 5]), torch.full((3, 2), 2, dtype=torch.int32), 4)
    assert inputs.input_ids[:4].tolist() == [5, 5, 5, 0] and inputs.out_cache_loc[:4].tolist() == [7, 7, 7, 0]
    assert inputs.seq_lens[:4].tolist() == [8, 8, 8, 1] and inputs.page_table[3].tolist() == [0, 0, 0, 0]


def test_cuda_graphs_none_is_off_on_a_cpu_and_true_is_refused():
    assert LLM(model="tiny", device="cpu").runner.graphs is None
    assert LLM(model="tiny", device="cpu", cuda_graphs=False).runner.graphs is None
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device, got device='cpu'"):
        LLM(model="tiny", device="cpu", cuda_graphs=True)
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match=r"cuda_graphs must be True or False"):
            LLM(model="tiny", device="cpu", cuda_graphs=bad)


@pytest.mark.process
def test_the_example_shows_the_sizes_and_the_padding_of_a_batch_of_5():
    out = " ".join(run_example("examples/ch13_cuda_graphs.py").split())
    assert "max_running=16 captured sizes [1, 2, 4, 8, 16]" in out
    assert "max_running=64 captured sizes [1, 2, 4, 8, 16, 32, 48, 64]" in out
    assert "5 -> 8, 9 -> 16, 17 -> 32, 50 -> 64" in out
    assert "a batch of 5 runs in the bucket of 8: rows 5-7 are padding (token 0, position 0, KV slot 0, one key)" in out
    assert out.count("│ 0 │ 0 │ 0 │ 1 │ [0, 0, 0, 0] │ padding │") == 3
    if torch.cuda.is_available():
        assert "replayed the bucket of [8]; tokens equal to the eager step's" in out


# ---- on any machine, with a stand-in for a graph

@pytest.fixture
def stand_in(monkeypatch):
    """A stand-in for torch.cuda.CUDAGraph on a CPU: `capture` keeps the function it would record and
    `replay` runs it again, over the same static buffers, which is what a replay computes (without the
    launches it saves). The buckets, the padding and the eager glue between replays run as on a GPU."""
    for module in (cuda_graph, graphs):              # the decode step's graphs and the verify step's
        monkeypatch.setattr(module, "capture", lambda device, forward, pool=None:
                            SimpleNamespace(replay=forward, pool=lambda: None))

    def engine(**options) -> LLM:
        llm = LLM(model="tiny", device="cpu", **options)
        llm.runner.init_graphs(llm.max_running)
        return llm
    return engine


MIXED = [SamplingParams(max_tokens=n) for n in (40, 3, 17, 33, 9)] + [
    SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=3), SamplingParams(max_tokens=12, temperature=1.2, seed=4)]


def tokens(llm: LLM) -> list[list[int]]:
    with no_hang(120):
        outs = llm.generate(PROMPTS, MIXED)
    llm.check_integrity()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mtp_steps", sampled([0, 1, 3], [0, 3]))
def test_with_a_stand_in_graph_tokens_equal_eager_tokens(stand_in, overlap, mtp_steps):
    """Seven prompts (two sampled, seeded), max_tokens 3..40, 8 request slots: batches of 7, 6, ... run in
    padded buckets, plain or as verify steps (draft, target and draft extend replays with the accept rule
    between them), and give exactly the eager engine's tokens."""
    graphed = stand_in(overlap=overlap, mtp_steps=mtp_steps, max_running=8)
    assert type(graphed.runner.graphs).__name__ == ("SpecGraphs" if mtp_steps else "DecodeGraphs")
    assert tokens(graphed) == tokens(LLM(model="tiny", device="cpu", overlap=overlap, mtp_steps=mtp_steps, max_running=8))


def test_a_verify_step_of_3_is_padded_to_the_bucket_of_4(stand_in):
    """Three requests in the bucket of 4 (k = 2, W = 3 rows each): the fourth request's rows read token 0 at
    position 0, write KV slot 0, see a page table of zeros, draft from token 0, and its last row is its own
    first row, whatever the buffers held before (filled with 7 here)."""
    llm = stand_in(mtp_steps=2, max_running=4)
    graphs, W = llm.runner.graphs, 3
    sizes = []
    draft = graphs.draft
    graphs.draft = lambda batch, *inputs: sizes.append(len(batch.reqs)) or draft(batch, *inputs)
    for buffer in (graphs.input_ids, graphs.next_ids, graphs.positions, graphs.out_cache_loc, graphs.seq_lens,
                   graphs.page_table, graphs.draft_token, graphs.draft_hidden, graphs.last):
        buffer.fill_(7)
    with no_hang(60):
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert sizes[0] == 3, "the first verify step holds all three (later ones, in smaller buckets, leave row 3 alone)"
    pad = slice(3 * W, 4 * W)
    for buffer in (graphs.input_ids, graphs.next_ids, graphs.positions, graphs.out_cache_loc):
        assert buffer[pad].tolist() == [0] * W
    assert graphs.seq_lens[3].item() == W and graphs.page_table[3].tolist() == [0] * graphs.page_table.shape[1]
    assert graphs.draft_token[3].item() == 0 and graphs.draft_hidden[3].abs().sum().item() == 0
    assert graphs.last[:4].tolist()[3] == 3 * W


def test_the_checker_is_silent_with_graphs_and_mtp_on_a_recycled_slot(stand_in):
    """One request slot, the overlap loop, MTP, graphs: B takes A's slot while A's wasted window is in flight.
    The draft extend still reads the page table itself, before its replay, and the fence's event still
    follows that read (chapter 12), so the checker is silent and the tokens are the eager engine's."""
    prompts, params = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 31))], SamplingParams(max_tokens=5, ignore_eos=True)
    llm = stand_in(overlap=True, mtp_steps=3, max_running=1, page_size=4, hazard_check=True)
    with no_hang(60):
        got = [o.token_ids for o in llm.generate(prompts, params)]
    llm.check_integrity()
    eager = LLM(model="tiny", device="cpu", overlap=True, mtp_steps=3, max_running=1, page_size=4)
    assert got == [o.token_ids for o in eager.generate(prompts, params)]


# ---- on a GPU

def run(overlap: bool, graphs: bool, **options) -> list[list[int]]:
    llm = LLM(model="tiny", device="cuda", dtype="float32", overlap=overlap, cuda_graphs=graphs, max_running=8, **options)
    with no_hang(120):
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in (40, 3, 17, 33, 9, 25, 12)])
    llm.check_integrity()
    return [o.token_ids for o in outs]


@GPU
@pytest.mark.parametrize("overlap", [False, True])
def test_graph_tokens_equal_eager_tokens(overlap):
    """Seven prompts, max_tokens 3..40, 8 request slots (so batches of 7, 6, ... replay padded buckets):
    the same tokens with and without graphs, in either loop; with MTP (three graphs a verify step) too."""
    assert run(overlap, True) == run(overlap, False)
    assert run(overlap, True, mtp_steps=3) == run(overlap, False)
    assert run(overlap, True, mtp_steps=1) == run(overlap, False, mtp_steps=1)


@GPU
def test_a_batch_of_5_replays_the_bucket_of_8():
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_running=8)
    assert llm.runner.graphs is not None and sorted(llm.runner.graphs.graphs) == [1, 2, 4, 8]
    replayed = []
    for b, graph in llm.runner.graphs.graphs.items():
        graph.replay = (lambda g, b: lambda: replayed.append(b) or g())(graph.replay, b)
    out = llm.generate(PROMPTS[:5], SamplingParams(max_tokens=4, ignore_eos=True))
    assert replayed == [8, 8, 8] and all(len(o.token_ids) == 4 for o in out)


@GPU
def test_with_mtp_a_batch_of_5_replays_the_three_graphs_of_the_bucket_of_8():
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_running=8, mtp_steps=2, overlap=False)
    graphs = llm.runner.graphs
    assert type(graphs).__name__ == "SpecGraphs" and sorted(graphs.graphs) == [1, 2, 4, 8]
    replayed = []
    for b, passes in graphs.graphs.items():
        for name, graph in zip(("draft", "target", "draft extend"), passes):
            graph.replay = (lambda g, b, name: lambda: replayed.append((b, name)) or g())(graph.replay, b, name)
    llm.generate(PROMPTS[:5], SamplingParams(max_tokens=1, ignore_eos=True))
    assert replayed == [], "a prefill runs eagerly"
    llm.generate(PROMPTS[:5], SamplingParams(max_tokens=2, ignore_eos=True))
    assert replayed == [(8, "draft"), (8, "target"), (8, "draft extend")]


@GPU
def test_the_checker_is_silent_with_graphs():
    """With graphs the step's shared reads still happen (and are recorded) before the replay, and the
    fence's event after them: the checker is silent over a run that recycles request slots."""
    for mtp_steps in (0, 3):
        llm = LLM(model="tiny", device="cuda", dtype="float32", max_running=2, hazard_check=True, mtp_steps=mtp_steps)
        with no_hang(120):
            llm.generate(PROMPTS, SamplingParams(max_tokens=12))
        llm.check_integrity()


@GPU
def test_a_graph_dropped_as_garbage_spoils_no_capture():
    """A graph that only the garbage collector can free (in a reference cycle, as a dropped engine's graphs
    are) while another is recorded: an automatic collection during the capture would run its destructor, a
    CUDA call that a capture forbids, and spoil the capture. capture keeps the collector off while it
    records, so the graph records and replays; the garbage is freed after."""
    import gc
    device = torch.device("cuda")
    x = torch.zeros(4, device=device)
    kept = [cuda_graph.capture(device, lambda: x.add_(1))]
    calls = []

    def forward() -> None:
        calls.append(1)
        if len(calls) == 2:                              # recording: the old graph becomes garbage ...
            cycle = [kept.pop()]
            cycle.append(cycle)
            del cycle
            objects = [[] for _ in range(5 * gc.get_threshold()[0])]   # ... and enough objects for a collection
            del objects
        x.mul_(2)

    graph = cuda_graph.capture(device, forward)
    gc.collect()
    x.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4 and len(calls) == 2
