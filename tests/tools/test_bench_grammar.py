"""tools/bench_grammar.py on a CPU, on a short stream: every row runs, in both ways, and the JSON holds what
chapter 19's figures read. The times themselves are not asserted: they are what the tool measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.process


def test_every_row_runs_and_the_json_holds_the_figures(tmp_path):
    out = tmp_path / "grammar.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "tools/bench_grammar.py", "--tokens", "12", "--arrive", "4", "--fields", "3",
                          "--repeats", "1", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["loop"], r["moment"], r["way"]) for r in rows] == [
        (loop, moment, way) for loop in ("normal", "overlap") for moment in ("first", "new")
        for way in ("sync", "background")]
    assert all(0 < r["median_ms"] <= r["longest_ms"] and 0 < r["arrival_ms"] <= r["longest_ms"] for r in rows)
    assert "overlap  new     background" in run.stdout
