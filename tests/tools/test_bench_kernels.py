"""tools/bench_kernels.py on a CPU: every case's two sides agree (the kernels in Triton's interpreter),
a case that differs is refused before it is timed, and the report of a recorded run."""

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
TOOL = ROOT / "tools" / "bench_kernels.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_kernels_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_case_s_fast_path_equals_its_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"      # the interpreter runs only where no GPU is
    errors = load_tool().check_cases("small", 3, 40, device)
    assert set(errors) == {"q/k/v projections", "gate/up projections", "add + RMSNorm", "q/k norm + RoPE", "SiLU x up",
                           "KV store", "decode attention", "verify attention, 4 rows"}
    assert errors["KV store"] == 0 and errors["q/k/v projections"] == 0 and errors["gate/up projections"] == 0


def test_a_case_whose_two_sides_differ_is_refused():
    tool = load_tool()
    want = torch.ones(4, dtype=torch.bfloat16)
    assert tool.close(want + 2 ** -7, want) == 2 ** -7             # one rounding: within two
    with pytest.raises(AssertionError, match="max error 0.5 > 0.0156"):
        tool.close(want + 0.5, want)


def test_report_reads_a_recorded_run(tmp_path):
    record = {"device": "a hand-made record", "torch": "-", "repeats": 50, "results": [
        {"shape": "8b", "batch": 1, "context": 4096, "case": "decode attention", "reference_us": 60.0, "fast_us": 12.0,
         "max_error": 0.0039}]}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(record))
    done = run_tool("--report", str(path))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "decode attention" in line)
    assert [c.strip() for c in line.strip("│ ").split("│")] == ["8b", "1", "4096", "decode attention", "60.0", "12.0",
                                                                  "5.00x", "0.0039"]


def test_report_reads_a_recorded_split_sweep(tmp_path):
    record = {"device": "a hand-made record", "torch": "-", "repeats": 20, "splits": [
        {"shape": "8b", "batch": 16, "context": 192, "splits": n, "us": us} for n, us in ((1, 8.9), (2, 9.0), (16, 13.4))]}
    path = tmp_path / "splits.json"
    path.write_text(json.dumps(record))
    done = run_tool("--report", str(path))
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "context" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")][3:] == ["1 split us", "2 splits us", "16 splits us"]
    line = next(line for line in done.stdout.splitlines() if "192" in line)
    assert [c.strip() for c in line.strip("│ ").split("│")] == ["8b", "16", "192", "8.9", "9.0", "13.4"]


def test_the_extend_kernels_equal_the_reference_and_the_flops_count_visible_pairs():
    """--extend's check on a CPU (the kernels in Triton's interpreter): a ragged batch with prefixes, a
    decode row and lengths no block divides; and its count, 4 * Hq * D per (query, visible key)."""
    tool = load_tool()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errors = tool.check_extend((4, 2, 32), device, torch.float32, ["32,16,4,2"])
    assert {"ch18 kernel", "flash kernel", "flash 32-16-4-2"} <= set(errors)
    assert tool.extend_flops((32, 8, 128), [0], [16000]) * 36 == pytest.approx(75.5e12, rel=1e-3)   # the 75
    assert tool.extend_flops((2, 1, 4), [3, 0], [2, 1]) == 4 * 2 * 4 * ((4 + 5) + 1)


def test_report_reads_a_recorded_extend_run(tmp_path):
    record = {"device": "a hand-made record", "torch": "-", "extend": [
        {"case": "prompt 16384", "batch": 1, "prefix": 0, "new": 16384, "variant": "flash kernel", "ms": 1.5,
         "tflops": 412.3, "max_error": 0.0039}]}
    path = tmp_path / "extend.json"
    path.write_text(json.dumps(record))
    done = run_tool("--report", str(path))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "16384" in line)
    assert [c.strip() for c in line.strip("│ ").split("│")] == ["prompt 16384", "flash kernel", "1.500", "412.3",
                                                                  "0.0039"]


def test_without_cuda_and_without_report_it_says_so_and_bad_arguments_name_the_flag():
    done = run_tool()
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr
    done = run_tool("--contexts", "0")
    assert done.returncode == 2 and "--contexts must be integers >= 1, got [0]" in done.stderr
    done = run_tool("--extend", "--prompt-lens", "1024", "0")
    assert done.returncode == 2 and "--prompt-lens must be integers >= 1, got [1024, 0]" in done.stderr
    done = run_tool("--splits", "4", "3")
    assert done.returncode == 2 and "--splits must be powers of two >= 1, got [4, 3]" in done.stderr
