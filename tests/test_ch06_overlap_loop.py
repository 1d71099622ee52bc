"""Chapter 06: the overlap loop launches step N+1 before it handles step N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from minioverlap import LLM, SamplingParams
from minioverlap.device.trace import chrome_trace

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]


def test_overlap_event_order_of_one_request_of_three_tokens():
    """One request, three tokens: launch 1, launch 2, handle 1, launch 3, handle 2, handle 3."""
    llm = LLM(model="tiny", overlap=True)
    llm.generate(["def f(x):"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.trace.order() == ["launch 1", "launch 2", "handle 1", "launch 3", "handle 2", "handle 3"]
    waits = [(e.kind, e.step) for e in llm.trace if e.kind in ("launch", "wait")]
    assert waits == [("launch", 1), ("launch", 2), ("wait", 1), ("launch", 3), ("wait", 2), ("wait", 3)]


def test_overlap_loop_computes_the_normal_loops_tokens():
    """Every token the overlap loop hands out is the normal loop's token at that position. (Where it
    stops is chapter 07's business: here it may stop one token early.)"""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    normal = LLM(model="tiny", overlap=False).generate(PROMPTS, params)
    overlap = LLM(model="tiny", overlap=True).generate(PROMPTS, params)
    for n, o in zip(normal, overlap):
        assert len(o.token_ids) >= 9 and o.token_ids == n.token_ids[:len(o.token_ids)]


def test_an_in_flight_step_keeps_its_batch_alive():
    """While a step is in flight, its record holds its batch and tensors, so nothing it reads is freed."""
    llm = LLM(model="tiny", overlap=True)
    sched = llm.scheduler
    for req in llm.make_requests(PROMPTS[:2], SamplingParams(max_tokens=4)):
        sched.add_request(req)
    last, _ = sched.overlap_loop(None)
    assert sched.in_flight == [last] and last.batch.input_ids.numel() > 0
    nxt, _ = sched.overlap_loop(last)
    assert sched.in_flight == [nxt], "step 1 was handled, step 2 is in flight"


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


def test_the_timeline_notebook_runs():
    """examples/ch06_timelines.ipynb runs top to bottom on the tiny model (both loops, no error) and
    draws its timelines: the output holds a figure (image/png)."""
    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parent.parent
    nb = nbformat.read(root / "examples" / "ch06_timelines.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(root)}})
    client.execute(env=dict(os.environ))          # the kernel imports the package the tests import
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs if o.output_type == "display_data")
