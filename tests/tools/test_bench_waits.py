"""tools/bench_waits.py on a CPU, on a few tokens: every case runs, the grammar's cases time their masks,
the n-gram cases their lookups and accept length, and the JSON holds what chapter 19's figures read."""

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
    out = tmp_path / "waits.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "tools/bench_waits.py", "--batches", "1", "2", "--tokens", "6",
                          "--repeats", "1", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == sorted(f"b{b}-{loop}-{kind}" for b in (1, 2) for loop in ("normal", "overlap")
                                  for kind in ("free", "grammar", "ngram"))
    for case, row in rows.items():
        assert row["tokens"] == row["batch"] * 6 and row["tok_s"] > 0 and row["ms_step"] > 0, case
        assert ("mask_us" in row) == (row["kind"] == "grammar") and ("lookup_us" in row) == (row["kind"] == "ngram")
    assert all(rows[f"b{b}-{loop}-grammar"]["mask_us"] > 0 for b in (1, 2) for loop in ("normal", "overlap"))
    assert "mask" in rows["b1-overlap-grammar"]["phases_us"] and "mask" not in rows["b1-normal-grammar"]["phases_us"]
    assert all(rows[f"b2-{loop}-ngram"]["accept_len"] >= 1 for loop in ("normal", "overlap"))
    assert "b2-overlap-ngram" in run.stdout


def test_the_mtp_cases_time_their_window_masks(tmp_path):
    """With MTP: the constrained case times its window masks, the overlap loop records `mask` (the verify's
    accept put off), and both cases report their accept length."""
    out = tmp_path / "waits.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "tools/bench_waits.py", "--batches", "2", "--tokens", "6", "--repeats", "1",
                          "--kinds", "mtp", "grammar-mtp", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == sorted(f"b2-{loop}-{kind}" for loop in ("normal", "overlap") for kind in ("mtp", "grammar-mtp"))
    assert all(rows[f"b2-{loop}-grammar-mtp"]["mask_us"] > 0 for loop in ("normal", "overlap"))
    assert all("mask_us" not in rows[f"b2-{loop}-mtp"] for loop in ("normal", "overlap"))
    assert "mask" in rows["b2-overlap-grammar-mtp"]["phases_us"] and "mask" not in rows["b2-normal-grammar-mtp"]["phases_us"]
    assert all(row["accept_len"] >= 1 for row in rows.values())
