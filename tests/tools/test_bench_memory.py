"""tools/bench_memory.py on a CPU, on a few requests: the worst-case pool and the same pool shared by need,
each loop; the JSON holds what chapter 21's figures read, and the report prints the recorded run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench_memory

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.process
def test_every_pool_runs_the_same_tokens_and_the_json_holds_the_figures(tmp_path):
    out = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "tools/bench_memory.py", "--requests", "12", "--max-tokens", "24",
                          "--contexts", "2", "--slots", "8", "--page-size", "4", "--repeats", "1", "--ratios", "0.7", "0.05",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["same_tokens"] is True
    rows = {(r["loop"], r["pool"]): r for r in data["results"]}
    assert sorted(rows) == sorted((loop, pool) for loop in ("normal", "overlap")
                                  for pool in ("worst-case", "by-need-0.7", "by-need-0.05"))
    for (loop, pool), r in rows.items():
        assert r["slots"] == (2 if pool == "worst-case" else 8)
        assert r["max_reqs"] <= r["slots"] and r["tok_s"] > 0 and len(r["runs"]) == 1
        if pool == "worst-case":
            assert r["retractions"] == 0, "a pool reserved for the worst case took a request back"
    assert rows[("normal", "by-need-0.05")]["max_reqs"] > 2, "admission by need ran no more than the worst case"
    assert "by-need-0.05" in run.stdout and "tokens the same in every run: True" in run.stdout


def test_the_report_of_the_recorded_run_prints_its_rows():
    data = json.loads((ROOT / "chapters" / "figures" / "21-cpu-memory.json").read_text())
    lines = bench_memory.report(data).splitlines()
    assert len(lines) == 2 + len(data["results"])
    for line, r in zip(lines[2:], data["results"]):
        assert line.split()[:3] == [r["loop"], r["pool"], str(r["slots"])]
        assert line.split()[-1] == f"{r['tok_s']:.0f}"
