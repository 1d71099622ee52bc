"""tools/bench_serving.py measures a real `minioverlap serve` on a tiny workload: every request completes
with exactly the tokens it asked for, the figures it records are consistent with its raw numbers, the
server it started exits on SIGTERM leaving nothing behind, and --report prints the table again; for a
checkpoint without tokenizer.json the prompts are token ids and every chunk's text is empty, yet each
chunk is timed. The configurations and the token-id workload are also checked in-process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bench_serving  # tools/ is on sys.path (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_serving.py"
DEVICE = os.environ.get("MINIOVERLAP_TEST_DEVICE", "cpu")
FLAT = ("req_s", "out_tok_s", "ttft_ms_mean", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99",
        "itl_ms_median", "itl_ms_p99", "e2e_ms_median", "tok_per_chunk", "completed", "requests")


def bench_serving_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), COLUMNS="200")
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


def check_requests(work: list[dict], run: dict) -> None:
    """Every request completed with the tokens it asked for, each chunk timed."""
    assert run["exit_code"] == 0 and run["left_behind"] == [] and "problem" not in run
    assert run["integrity"]["idle"] and run["integrity"]["problems"] is None
    for w, r in zip(work, run["per_request"], strict=True):
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["output_tokens"] == w["output_len"], "ignore_eos: exactly the tokens asked for"
        assert r["prompt_tokens"] > 0 and 0 < r["ttft_s"] <= r["latency_s"]
        assert 1 <= r["chunks"] <= r["output_tokens"] and len(r["itl_s"]) == r["chunks"] - 1
        assert all(gap > 0 for gap in r["itl_s"])


@pytest.mark.process
def test_the_serving_benchmark_measures_every_request_and_reports_it_again(tmp_path):
    out = tmp_path / "bs.json"
    run = bench_serving_run("--configs", "overlap+ftf", "--device", DEVICE, "--num-requests", "6",
                            "--request-rate", "20", "--input-len", "4..12", "--output-len", "3..8", "--seed", "1",
                            "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads(out.read_text())
    assert (record["device"], record["model"], record["mode"]) == (DEVICE, "tiny", "rate 20")

    work = record["workload"]
    assert work["request_rate"] == 20 and work["input_unit"] == "words" and len(work["requests"]) == 6
    arrivals = [w["arrival_s"] for w in work["requests"]]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert all(isinstance(w["prompt"], str) and 4 <= w["input_len"] <= 12 and 3 <= w["output_len"] <= 8
               for w in work["requests"])

    (config,) = record["runs"]
    assert (config["config"], config["loop"], config["mtp"], config["ftf"]) == ("overlap+ftf", "overlap", 0, True)
    assert "--first-tokens-first" in config["command"]
    check_requests(work["requests"], config)

    (result,) = record["results"]
    assert result["config"] == "overlap+ftf"
    assert all(isinstance(result[name], (int, float)) for name in FLAT), "flat numbers a chapter can quote"
    assert result["completed"] == result["requests"] == 6
    assert result["output_tokens"] == result["requested_tokens"] == sum(w["output_len"] for w in work["requests"])
    assert result["duration_s"] > 0
    # the record keeps six decimals, so a ratio recomputed from the rounded duration agrees to about 1e-5
    assert result["out_tok_s"] == pytest.approx(result["output_tokens"] / result["duration_s"], rel=1e-4)
    assert result["req_s"] == pytest.approx(6 / result["duration_s"], rel=1e-4)
    chunks = sum(r["chunks"] for r in config["per_request"])
    assert result["tok_per_chunk"] == pytest.approx(result["output_tokens"] / chunks, rel=1e-4)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < result[f"{name}_ms_median"] <= result[f"{name}_ms_p99"], name
    assert result["ttft_ms_median"] < result["e2e_ms_median"]

    again = bench_serving_run("--report", str(out))
    assert again.returncode == 0, again.stderr
    assert "TTFT med" in again.stdout and "overlap+ftf" in again.stdout and "6/6" in again.stdout


@pytest.mark.process
def test_a_checkpoint_without_a_tokenizer_gets_token_ids_and_its_empty_chunks_are_timed(tmp_path):
    model = tmp_path / "tiny-without-tokenizer"
    shutil.copytree(ROOT / "minioverlap" / "checkpoints" / "tiny", model, ignore=shutil.ignore_patterns("tokenizer*"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out = tmp_path / "ids.json"
    run = bench_serving_run("--configs", "normal", "--model", str(model), "--device", DEVICE, "--num-requests", "4",
                            "--input-len", "5..9", "--output-len", "3..5", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads(out.read_text())
    assert record["mode"] == "all at once" and record["workload"]["input_unit"] == "tokens"
    work, (config,) = record["workload"]["requests"], record["runs"]
    assert all(all(10 <= t < vocab for t in w["prompt"]) and len(w["prompt"]) == w["input_len"] for w in work)
    check_requests(work, config)
    for w, r in zip(work, config["per_request"]):
        assert r["prompt_tokens"] == w["input_len"]
        assert r["empty_chunks"] == r["chunks"], "no tokenizer: no text, but the chunks still carry the tokens"
    assert record["results"][0]["completed"] == 4


def test_configurations_name_a_loop_its_drafts_and_first_tokens_first():
    parsed = bench_serving.configs("normal,overlap+ftf,overlap+mtp2+ftf,normal+mtp3")
    assert [(c["name"], c["loop"], c["mtp"], c["ftf"]) for c in parsed] == [
        ("normal", "normal", 0, False), ("overlap+ftf", "overlap", 0, True),
        ("overlap+mtp2+ftf", "overlap", 2, True), ("normal+mtp3", "normal", 3, False)]
    for bad in ("normal+ftf", "overlap+ftf+mtp2", "overlap+mtp0", "fast", "overlap,overlap"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.configs(bad)


def test_a_token_id_workload_is_seeded_and_inside_the_vocabulary():
    args = bench_serving.parse_args(["--num-requests", "5", "--input-len", "3..7", "--output-len", "2..4",
                                     "--request-rate", "10", "--seed", "3"])
    work = bench_serving.make_workload(args, vocab_size=50)
    assert work == bench_serving.make_workload(args, vocab_size=50)
    assert all(len(w["prompt"]) == w["input_len"] and 3 <= w["input_len"] <= 7 for w in work)
    assert all(10 <= t < 50 for w in work for t in w["prompt"]) and len({t for w in work for t in w["prompt"]}) > 5
    assert isinstance(bench_serving.make_workload(args)[0]["prompt"], str)
    assert bench_serving.token_id_vocab("tiny") is None, "the shipped model has a tokenizer: text prompts"
