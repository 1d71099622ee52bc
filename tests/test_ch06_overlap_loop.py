"""Chapter 06: the overlap loop launches step N+1 before it handles step N."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import run_example
from minioverlap import LLM, SamplingParams
from minioverlap.device.streams import Streams
from minioverlap.device.trace import Trace, chrome_trace

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]


def test_overlap_event_order_of_one_request_of_three_tokens():
    """One request, three tokens: launch 1, launch 2, handle 1, launch 3, handle 2, handle 3."""
    llm = LLM(model="tiny", overlap=True)
    llm.generate(["def f(x):"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.trace.order() == ["launch 1", "launch 2", "handle 1", "launch 3", "handle 2", "handle 3"]
    waits = [(e.kind, e.step) for e in llm.trace if e.kind in ("launch", "wait")]
    assert waits == [("launch", 1), ("launch", 2), ("wait", 1), ("launch", 3), ("wait", 2), ("wait", 3)]


def test_overlap_loop_computes_the_normal_loops_tokens():
    """Each request of the overlap loop ends with exactly the normal loop's tokens, all 10 of max_tokens.
    (What a streaming client sees, and stop tokens, are chapter 07's business.)"""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    normal = LLM(model="tiny", overlap=False).generate(PROMPTS, params)
    overlap = LLM(model="tiny", overlap=True).generate(PROMPTS, params)
    assert [len(n.token_ids) for n in normal] == [10] * len(PROMPTS)
    assert [o.token_ids for o in overlap] == [n.token_ids for n in normal]


def test_an_in_flight_step_keeps_its_batch_alive():
    """While a step is in flight, the scheduler's record of it holds its batch, the batch's tensors and the
    sampled tokens even when the caller drops its own reference, so nothing the step reads or writes is
    freed (on a GPU the caching allocator would hand that memory to the next step)."""
    llm = LLM(model="tiny", overlap=True)
    sched, ran, forward = llm.scheduler, [], llm.runner.forward
    llm.runner.forward = lambda batch, *inputs: ran.append(batch) or forward(batch, *inputs)   # the batch the step runs on
    for req in llm.make_requests(PROMPTS[:2], SamplingParams(max_tokens=4)):
        sched.add_request(req)
    last, _ = sched.overlap_loop(None)
    [b] = ran
    alive = [weakref.ref(x) for x in (b, last.input_ids, b.positions, b.out_cache_loc, b.seq_lens, last.next_tokens)]
    del last, b
    ran.clear()
    gc.collect()
    assert all(ref() is not None for ref in alive), "the in-flight record keeps step 1's batch and tensors"
    [last] = sched.in_flight
    assert last.batch is alive[0](), "the record holds the very batch the step ran on"
    nxt, _ = sched.overlap_loop(last)
    assert sched.in_flight == [nxt], "step 1 was handled, step 2 is in flight"


def test_the_callers_code_runs_outside_the_engines_stream_between_replies(monkeypatch):
    """The engine's schedule stream is current only inside an iteration of the loop, never while the
    caller holds a reply: not in the caller's loop body, not after it leaves a stream early and another
    engine runs (on a GPU the thread's current stream is the default one at every reply)."""
    inside = []
    real = Streams.schedule

    @contextmanager
    def schedule(self):
        with real(self):
            inside.append(self)
            try:
                yield
            finally:
                inside.remove(self)
    monkeypatch.setattr(Streams, "schedule", schedule)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for overlap in (False, True):
        a, b = LLM(model="tiny", overlap=overlap), LLM(model="tiny", overlap=overlap)
        on_gpu = a.runner.streams.cuda
        default = torch.cuda.default_stream() if on_gpu else None
        left = a.stream(PROMPTS, params)
        next(left)                                              # a's caller holds a reply and keeps the stream open
        assert inside == [] and (not on_gpu or torch.cuda.current_stream() == default)
        seen = [(list(inside), on_gpu and torch.cuda.current_stream() != default) for _ in b.stream(PROMPTS, params)]
        assert seen == [([], False)] * len(seen) and len(seen) >= 6
        left.close()
        assert inside == [] and (not on_gpu or torch.cuda.current_stream() == default)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_driven_by_hand_waits_for_the_callers_stream():
    """Driven by hand, outside Scheduler.run, the scheduler queues a step's inputs on the caller's stream,
    here held up by a ~50 ms kernel before every iteration: the forward stream waits for that stream,
    so the tokens equal generate's."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(model="tiny", device="cuda", dtype="float32", cuda_graphs=False)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    reqs = llm.make_requests(PROMPTS, params)
    for req in reqs:
        llm.scheduler.add_request(req)
    while llm.scheduler.busy:
        torch.cuda._sleep(100_000_000)                  # GPU clock cycles on the caller's (default) stream
        llm.scheduler.normal_loop()
    assert [req.output_ids for req in reqs] == expected


@pytest.mark.process
def test_trace_compare_prints_both_orders_and_writes_a_perfetto_file(tmp_path):
    """`minioverlap trace --compare --chrome FILE` prints both exact orders and writes trace-event JSON
    with one process per loop."""
    path = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "minioverlap", "trace", "--compare", "--chrome", str(path)],
                         capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "120"})
    assert "normal:  launch 1, handle 1, launch 2, handle 2, launch 3, handle 3" in run.stdout
    assert "overlap: launch 1, launch 2, handle 1, launch 3, handle 2, handle 3" in run.stdout
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"normal loop", "overlap loop"}
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in slices} >= {"launch 1", "process 3"} and all(e["dur"] >= 0 for e in slices)


def test_the_chrome_trace_has_a_track_for_the_forward_stream_when_there_are_gpu_times():
    """Given GPU spans (as CUDA timing events give them on a GPU), the Perfetto file has a second track
    per loop, the forward stream, one slice per step at its GPU start; with none, only the host track."""
    llm = LLM(model="tiny", max_running=2)
    llm.generate(["def f(x):"], SamplingParams(max_tokens=3))
    trace = llm.trace
    if not trace.gpu:                                                   # a CPU: the host track alone
        assert {e["tid"] for e in chrome_trace({"overlap": trace})["traceEvents"] if e["ph"] == "X"} == {1}
    trace.gpu = {1: (0.0, 1.5), 2: (1.625, 2.5), 3: (2.75, 3.0)}        # ms since step 1 began on the GPU
    events = chrome_trace({"overlap": trace})["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {1: "scheduler (host)", 2: "forward stream (GPU)"}
    gpu = [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 2]
    assert gpu == [("step 1", 0.0, 1500.0), ("step 2", 1625.0, 875.0), ("step 3", 2750.0, 250.0)]


@pytest.mark.process
def test_the_timeline_notebook_runs():
    """examples/ch06_timelines.ipynb runs top to bottom on the tiny model (both loops, no error) and
    draws its timelines: two figures, and on a machine without a GPU a third, the recorded H200 trace."""
    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parent.parent
    nb = nbformat.read(root / "examples" / "ch06_timelines.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(root)}})
    client.execute(env=dict(os.environ))          # the kernel imports the package the tests import
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == (2 if torch.cuda.is_available() else 3), "without a GPU, the recorded H200 trace too"


@pytest.mark.process
def test_the_example_prints_both_orders_and_equal_tokens():
    """`python examples/ch06_overlap_loop.py` prints the two loops' orders side by side and finds the
    same tokens in both for 16 requests."""
    out = run_example("examples/ch06_overlap_loop.py")
    lines = out.splitlines()
    assert "  normal:  launch 1, handle 1, launch 2, handle 2, launch 3, handle 3" in lines
    assert "  overlap: launch 1, launch 2, handle 1, launch 3, handle 2, handle 3" in lines
    assert "16 requests of 32 tokens: same tokens in both loops: True" in lines


# ---- the whole trace of a small run, in both loops; GPU spans from timing events

def test_whole_trace_of_two_requests_in_both_loops():
    """Every event of a run of two requests, A (max_tokens=2) and B (4), as (kind, step, requests): the
    normal loop runs each step to its reply; the overlap loop launches N+1 before it waits for N, stops
    launching A once A has launched its last step, and handles the last step with nothing left to launch."""
    params = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]
    B, AB = (1,), (0, 1)
    normal = LLM(model="tiny", overlap=False)
    normal.generate([[5, 6, 7], [8, 9]], params)
    assert [(e.kind, e.step, e.uids) for e in normal.trace] == [
        ("schedule", 1, AB), ("launch", 1, AB), ("wait", 1, AB), ("process", 1, AB), ("reply", 1, AB),
        ("schedule", 2, AB), ("launch", 2, AB), ("wait", 2, AB), ("process", 2, AB), ("reply", 2, AB),
        ("schedule", 3, B), ("launch", 3, B), ("wait", 3, B), ("process", 3, B), ("reply", 3, B),
        ("schedule", 4, B), ("launch", 4, B), ("wait", 4, B), ("process", 4, B), ("reply", 4, B)]
    overlap = LLM(model="tiny", overlap=True)
    overlap.generate([[5, 6, 7], [8, 9]], params)
    assert [(e.kind, e.step, e.uids) for e in overlap.trace] == [
        ("schedule", 1, AB), ("launch", 1, AB),
        ("schedule", 2, AB), ("launch", 2, AB), ("wait", 1, AB), ("process", 1, AB), ("reply", 1, AB),
        ("schedule", 3, B), ("launch", 3, B), ("wait", 2, AB), ("process", 2, AB), ("reply", 2, AB),
        ("schedule", 4, B), ("launch", 4, B), ("wait", 3, B), ("process", 3, B), ("reply", 3, B),
        ("wait", 4, B), ("process", 4, B), ("reply", 4, B)]


class FakeTimingEvent:
    """What the trace uses of a CUDA timing event: elapsed_time(other), the ms from this event to other."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: "FakeTimingEvent") -> float:
        return other.ms - self.ms


def test_gpu_spans_and_gaps_from_timing_events():
    """record_gpu keeps each handled step's GPU (start, end) in ms from the first step's start, and
    gpu_gaps_ms is the GPU's idle time before each step, start(N) - end(N-1): hand-computed here on fake
    timing events (CUDA's exist only on a GPU). A CPU's None events record nothing."""
    trace = Trace()
    trace.record_gpu(1, None, None)
    assert trace.gpu == {} and trace.gpu_gaps_ms() == []
    for step, (start, end) in {1: (100.0, 101.5), 2: (101.625, 102.5), 3: (102.75, 103.0)}.items():
        trace.record_gpu(step, FakeTimingEvent(start), FakeTimingEvent(end))
    assert trace.gpu == {1: (0.0, 1.5), 2: (1.625, 2.5), 3: (2.75, 3.0)}
    assert trace.gpu_gaps_ms() == [0.125, 0.25]


@pytest.mark.process
def test_generate_serves_the_prompt_with_either_loop():
    """`minioverlap generate --loop normal` and `--loop overlap` stream the same completion."""
    outs = [subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", "--max-tokens", "6",
                            "--loop", loop], capture_output=True, text=True, timeout=300) for loop in ("normal", "overlap")]
    assert [o.returncode for o in outs] == [0, 0], outs[0].stderr + outs[1].stderr
    assert outs[0].stdout == outs[1].stdout and "(6 tokens, finish_reason=length)" in outs[0].stdout


@pytest.mark.process
def test_trace_chrome_makes_its_folder_and_gives_every_event_its_slice(tmp_path):
    """`--chrome` into a folder that does not exist yet creates it. The host track has one slice per
    event, schedule 1 first, from the run's start: the slices follow one another with no gap. A path
    whose folder cannot be made is refused before anything runs."""
    path = tmp_path / "traces" / "today" / "trace.json"
    run = subprocess.run([sys.executable, "-m", "minioverlap", "trace", "--loop", "overlap", "--chrome", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    host = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert len(host) == 15 and host[0]["name"] == "schedule 1" and host[0]["ts"] == 0 and host[0]["dur"] > 0
    assert all(abs(a["ts"] + a["dur"] - b["ts"]) < 1e-3 for a, b in zip(host, host[1:]))
    (tmp_path / "a_file").write_text("")
    bad = subprocess.run([sys.executable, "-m", "minioverlap", "trace", "--chrome", str(tmp_path / "a_file" / "t.json")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--chrome" in bad.stderr and "cannot make its folder" in bad.stderr
    assert "the normal loop" not in bad.stdout and "Traceback" not in bad.stderr


def test_the_chrome_trace_starts_the_first_phase_at_the_runs_start():
    """Given the run's start, the first event's slice starts there, at 0, and the GPU track (if any)
    keeps step 1 where the host scheduled it; without one, the first slice has no length."""
    import time

    llm = LLM(model="tiny")
    start = time.perf_counter_ns()
    llm.generate(["def f(x):"], SamplingParams(max_tokens=2, ignore_eos=True))
    trace = llm.trace
    trace.gpu = {1: (0.0, 1.5), 2: (1.625, 2.5)}
    events = chrome_trace({"normal": trace}, {"normal": start})["traceEvents"]
    host = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    scheduled = (trace[0].t_ns - start) / 1e3
    assert (host[0]["name"], host[0]["ts"], host[0]["dur"]) == ("schedule 1", 0.0, scheduled) and scheduled > 0
    assert [e["ts"] for e in events if e["ph"] == "X" and e["tid"] == 2] == [scheduled, scheduled + 1625.0]
    first = [e for e in chrome_trace({"normal": trace})["traceEvents"] if e["ph"] == "X"][0]
    assert (first["name"], first["ts"], first["dur"]) == ("schedule 1", 0.0, 0.0)
