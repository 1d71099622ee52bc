"""Chapter 12 as a reader runs it: the chapter's example, and `minioverlap trace --compare --mtp K`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import run_example


@pytest.mark.process
def test_the_chapters_example_shows_equal_tokens_and_one_wasted_window_per_request():
    """The example serves two requests (max_tokens=24, k=3) in both loops: the same tokens, equal to plain
    greedy; in the overlap loop each request is launched once more in the step after the one that finished
    it, and that step replies nothing to it; with one request slot, so that the second request takes the
    first one's row during its wasted window, the checker stays silent and the host waits only for
    copy-done events."""
    out = run_example("examples/ch12_spec_overlap.py")
    assert "tokens: overlap == normal == plain greedy" in out
    assert "wasted windows: 2 (launched after the finish, no reply)" in out
    late = re.findall(r"request (\d+): finished in step (\d+), launched again in step (\d+), no reply", out)
    assert sorted(uid for uid, _, _ in late) == ["0", "1"]
    assert all(int(again) == int(done) + 1 for _, done, again in late), late
    steps = re.search(r"steps: normal (\d+), overlap (\d+)", out)
    assert steps and int(steps[2]) == int(steps[1]) + 1, "the last request's wasted window is a step of its own"
    lengths = re.search(r"accept lengths: (\d+\.\d\d), (\d+\.\d\d) \(tokens / passes\)", out)
    assert lengths and all(1.0 <= float(x) <= 4.0 for x in lengths.groups())
    assert re.search(r"hazard checker: silent \(1 request slot; \d+ host waits, all copy-done\)", out), out
    assert "HazardError" not in out


def trace_mtp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minioverlap", "trace", "--compare", "--mtp", "3", "--max-tokens", "8",
                           *args], capture_output=True, text=True, timeout=300)


def event_order(text: str, loop: str) -> list[str]:
    """The 'loop: launch 1, handle 1, ...' line of the output (rich may wrap it), as a list."""
    m = re.search(rf"{loop}: ((?:launch|handle) \d+(?:, (?:launch|handle) \d+)*)", " ".join(text.split()))
    assert m, text
    return m[1].split(", ")


@pytest.mark.process
def test_trace_compare_mtp_prints_both_loops_of_a_speculative_run(tmp_path):
    """`minioverlap trace --compare --mtp 3 --max-tokens 8` runs one speculative request in both loops and
    prints both: the normal loop alternates launch N, handle N; the overlap loop launches N+1 before it
    handles N and runs one step more, the window it launched after the request's last step. `--chrome FILE`
    writes both loops, the overlap loop's last step replying to nobody."""
    path = tmp_path / "trace.json"
    run = trace_mtp("--chrome", str(path))
    assert run.returncode == 0, run.stderr
    assert "the normal loop" in run.stdout and "the overlap loop" in run.stdout
    normal, overlap = event_order(run.stdout, "normal"), event_order(run.stdout, "overlap")
    n = len(normal) // 2
    assert normal == [f"{kind} {i}" for i in range(1, n + 1) for kind in ("launch", "handle")]
    assert 2 <= n < 8, "MTP: fewer steps than tokens"
    m = n + 1                                      # one wasted window: launched before the last step was handled
    assert overlap == (["launch 1"] + [e for i in range(1, m) for e in (f"launch {i + 1}", f"handle {i}")]
                       + [f"handle {m}"])

    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["normal loop", "overlap loop"]
    slices = {loop: [e for e in events if e["ph"] == "X" and e["pid"] == pid] for pid, loop in names.items()}
    launches = {loop: [e["name"] for e in s if e["name"].startswith("launch")] for loop, s in slices.items()}
    assert launches == {"normal loop": [f"launch {i}" for i in range(1, n + 1)],
                        "overlap loop": [f"launch {i}" for i in range(1, m + 1)]}
    replies = {e["name"]: e["args"]["requests"] for e in slices["overlap loop"] if e["name"].startswith("reply")}
    assert replies[f"reply {m}"] == [] and all(replies[f"reply {i}"] == [0] for i in range(1, m))
