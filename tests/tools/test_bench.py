"""tools/bench.py on a CPU: the report of a recorded run, merging runs, and the argument checks.

The fixture tests/tools/fixtures/bench_format.json is hand-written in the format a GPU run records
(its "note" says so); the benchmark itself needs a CUDA GPU and is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench.py"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "bench_format.json"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_tool", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line_of(text: str, *parts: str) -> str:
    """The one table line that holds every part."""
    lines = [line for line in text.splitlines() if all(p in line for p in parts)]
    assert len(lines) == 1, (parts, lines)
    return lines[0]


def test_report_prints_the_fixture_with_ratios_to_hf_compile(tmp_path):
    record = json.loads(FIXTURE.read_text())
    assert record["note"] == "format fixture for tests, not a measurement"
    done = run_bench("--report", str(FIXTURE), "--png", str(tmp_path / "plot.png"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Qwen3-0.6b shape" in out and "Qwen3-8b shape" in out
    # 0.6b, batch 1: overlap-graphs 1523 tok/s against hf-compile's 402 -> 3.79x; 0.66 ms/step, 2.37x the HBM bound
    row = line_of(out, " 1 ", "overlap-graphs", "1523")
    assert f"{1523.0 / 402.0:.2f}x" == "3.79x" and "3.79x" in row
    assert "0.66" in row and "2.37" in row and "0.012" in row and "0.318" in row
    # 0.6b, batch 16: 21800 / 5120 -> 4.26x
    assert "4.26x" in line_of(out, " 16 ", "overlap-graphs", "21800")
    # hf-compile is 1.00x of itself; transformers has no GPU gap or CPU time per step
    assert "1.00x" in line_of(out, " 16 ", "hf-compile", "5120")
    assert line_of(out, " 1 ", "hf-eager", "42").rstrip("│ ").endswith("-")
    # 8b: 262.4 / 221 -> 1.19x
    assert "1.19x" in line_of(out, "overlap-graphs", "262")
    assert "15.14 GB read per step" in out and "HBM bound 3.520 ms/step" in out
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_merge_replaces_a_remeasured_row_and_keeps_the_rest():
    bench = load_bench()
    old = json.loads(FIXTURE.read_text())
    again = dict(old["results"][3], tok_s=1600.0)                      # 0.6b, batch 1, overlap-graphs
    new_row = dict(old["results"][3], batch=4, tok_s=5000.0)
    new = {**{k: v for k, v in old.items() if k not in ("note", "results")}, "copy_GBps": 4400.0,
           "results": [new_row, again]}
    merged = bench.merge(old, new)
    assert merged["copy_GBps"] == 4400.0 and merged["note"] == old["note"]
    assert len(merged["results"]) == len(old["results"]) + 1
    keys = [(r["shape"], r["batch"], r["system"]) for r in merged["results"]]
    assert len(set(keys)) == len(keys)
    assert keys.index(("0.6b", 4, "overlap-graphs")) == keys.index(("0.6b", 1, "overlap-graphs")) + 1   # batch order
    by_key = {(r["shape"], r["batch"], r["system"]): r for r in merged["results"]}
    assert by_key["0.6b", 1, "overlap-graphs"]["tok_s"] == 1600.0
    assert by_key["8b", 1, "hf-compile"] == old["results"][8]
    assert bench.merge(None, new) is new
    with pytest.raises(bench.MergeError, match="tokens 128"):
        bench.merge(old, {**new, "tokens": 64})


@pytest.mark.parametrize("args, field", [
    (["--shapes", "7b"], "--shapes"), (["--systems", "vllm"], "--systems"), (["--batches", "1", "0"], "--batches"),
    (["--tokens", "0"], "--tokens"), (["--repeats", "0"], "--repeats"),
])
def test_bad_arguments_exit_2_naming_the_field(args, field, capsys):
    with pytest.raises(SystemExit) as raised:
        load_bench().main(args)
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {field}" in error and repr(args[-1]) in error, error


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the benchmark would run")
def test_without_cuda_and_without_report_exits_1_with_a_message():
    done = run_bench("--batches", "1", "--tokens", "4")
    assert done.returncode == 1
    assert "needs a CUDA GPU; --report FILE reads a recorded run" in done.stderr
