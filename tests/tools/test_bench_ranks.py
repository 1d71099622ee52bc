"""tools/bench_ranks.py on a CPU, on a few tokens: one rank and two, tensor-parallel and under DP attention,
each loop; the JSON holds what chapter 20's figures read, the share timed on both ranks, the agreement
under DP attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.process


def test_every_case_runs_and_the_json_holds_the_figures(tmp_path):
    out = tmp_path / "ranks.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "tools/bench_ranks.py", "--batches", "2", "--tokens", "4", "--repeats", "1",
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == sorted(f"{kind}-b2-{loop}" for kind in ("tp1", "tp2", "dp2") for loop in ("normal", "overlap"))
    for case, row in rows.items():
        assert row["tok_s"] > 0 and row["ms_step"] > 0 and row["launch_us_rank0"] > 0, case
        assert ("share_us_rank1" in row) == (row["tp"] == 2) and ("share_us_rank0" in row) == (row["tp"] == 2), case
        assert ("agree_us_rank0" in row) == row["dp_attention"], case
    assert "tp2-b2-overlap" in run.stdout and "dp2-b2-overlap" in run.stdout
