"""tools/bench_serving.py measures a real `minioverlap serve` on a tiny workload: every request completes
with exactly the tokens it asked for, the figures it records are consistent with its raw numbers, the
server it started exits on SIGTERM leaving nothing behind, and --report prints the table again; for a
checkpoint without tokenizer.json the prompts are token ids and every chunk's text is empty, yet each
chunk is timed; a server with the prefix cache (+cache) reports the shared-prefix workload's hits. The
configurations (a server without +cache is started with --no-prefix-cache, one without +chunkN with
--chunked-prefill-size -1), the token-id workload, the shared-prefix workload (a group's prompts share
exactly their system prompt's tokens), the long-among-short workload (long prompts of the tokens asked
for, among streams) and the hit rate are also checked in-process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

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
    assert config["cache"] is False and "--no-prefix-cache" in config["command"], "no +cache: the cache is off"
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
    assert result["cached_tokens"] == 0 and result["hit_rate"] == 0, "a server without the cache finds nothing"

    again = bench_serving_run("--report", str(out))
    assert again.returncode == 0, again.stderr
    assert "TTFT med" in again.stdout and "overlap+ftf" in again.stdout and "6/6" in again.stdout
    assert "hit" in again.stdout and "0.0%" in again.stdout


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


@pytest.mark.process
def test_a_server_with_the_cache_finds_each_groups_system_prompt_after_its_first_request(tmp_path):
    out = tmp_path / "gsp.json"
    run = bench_serving_run("--configs", "normal+cache", "--device", DEVICE, "--dataset", "generated-shared-prefix",
                            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
                            "--gsp-question-len", "4", "--gsp-output-len", "3", "--compare-ttft", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads(out.read_text())
    work, (config,), (result,) = record["workload"], record["runs"], record["results"]
    assert work["dataset"] == "generated-shared-prefix" and work["num_requests"] == 6
    assert config["cache"] is True and "--prefix-cache" in config["command"]
    assert "--no-prefix-cache" not in config["command"]
    assert work["warmup_request"]["group"] is None, "the warm-up's system prompt is no group's"
    check_requests(work["requests"], config)
    seen = set()
    for w, r in zip(work["requests"], config["per_request"]):
        # one at a time: the first of a group computes its system prompt, the others find it (whole pages)
        first = w["group"] not in seen
        seen.add(w["group"])
        assert (r["cached_tokens"] == 0) if first else (0 < r["cached_tokens"] < r["prompt_tokens"]), (w, r)
        assert r["cached_tokens"] % 16 == 0, "the cache holds whole pages (page_size 16)"
    assert result["cached_tokens"] == sum(r["cached_tokens"] for r in config["per_request"]) > 0
    assert result["hit_rate"] == pytest.approx(result["cached_tokens"] / result["input_tokens"], rel=1e-4)
    assert f"{100 * result['hit_rate']:.1f}%" in run.stdout


def test_configurations_name_a_loop_its_drafts_and_first_tokens_first():
    parsed = bench_serving.configs("normal,overlap+ftf,overlap+mtp2+ftf,normal+mtp3")
    assert [(c["name"], c["loop"], c["mtp"], c["ftf"]) for c in parsed] == [
        ("normal", "normal", 0, False), ("overlap+ftf", "overlap", 0, True),
        ("overlap+mtp2+ftf", "overlap", 2, True), ("normal+mtp3", "normal", 3, False)]
    for bad in ("normal+ftf", "overlap+ftf+mtp2", "overlap+mtp0", "fast", "overlap,overlap"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.configs(bad)


def test_the_prefix_cache_is_on_only_where_a_configuration_asks_for_it(monkeypatch):
    parsed = bench_serving.configs("normal,normal+cache,overlap+mtp2+ftf+cache,overlap+ftf")
    assert [(c["name"], c["loop"], c["mtp"], c["ftf"], c["cache"]) for c in parsed] == [
        ("normal", "normal", 0, False, False), ("normal+cache", "normal", 0, False, True),
        ("overlap+mtp2+ftf+cache", "overlap", 2, True, True), ("overlap+ftf", "overlap", 0, True, False)]
    for bad in ("normal+cache+ftf", "overlap+cache+mtp2", "normal+cache+cache", "cache", "normal,normal+cache,normal"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.configs(bad)

    started = []

    class NotStarted:                                   # the command line the Server class builds, nothing run
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
    monkeypatch.setattr(bench_serving.subprocess, "Popen", NotStarted)
    commands = {c["name"]: bench_serving.ServerProcess(c, "tiny", "cpu", max_running=4).cmd for c in parsed}
    assert started == list(commands.values())
    for name, cmd in commands.items():
        cache = name.endswith("+cache")
        assert ("--prefix-cache" in cmd, "--no-prefix-cache" in cmd) == (cache, not cache), (name, cmd)
        assert cmd[cmd.index("--loop") + 1] == name.split("+")[0] and ("--first-tokens-first" in cmd) == ("ftf" in name)
    assert "--mtp" in commands["overlap+mtp2+ftf+cache"] and "--mtp" not in commands["normal+cache"]


def test_chunked_prefill_is_on_only_where_a_configuration_asks_for_it(monkeypatch):
    parsed = bench_serving.configs("normal,overlap+chunk64,overlap+cache+chunk32+mixed,normal+mtp2+chunk128")
    assert [(c["name"], c["cache"], c["chunk"], c["mixed"]) for c in parsed] == [
        ("normal", False, None, False), ("overlap+chunk64", False, 64, False),
        ("overlap+cache+chunk32+mixed", True, 32, True), ("normal+mtp2+chunk128", False, 128, False)]
    for bad in ("overlap+mixed", "overlap+mixed+chunk64", "overlap+chunk0", "overlap+chunk64+cache",
                "overlap+mtp2+chunk64+mixed", "normal+chunk"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.configs(bad)
    monkeypatch.setattr(bench_serving.subprocess, "Popen", lambda cmd, **kwargs: None)
    for c in parsed:
        cmd = bench_serving.ServerProcess(c, "tiny", "cpu").cmd
        size = cmd[cmd.index("--chunked-prefill-size") + 1]
        assert size == (str(c["chunk"]) if c["chunk"] else "-1"), "without +chunkN, every prompt whole"
        assert ("--enable-mixed-chunk" in cmd) == c["mixed"], (c["name"], cmd)


def test_a_long_among_short_workload_sends_long_prompts_among_the_streams():
    argv = ["--dataset", "long-among-short", "--las-streams", "5", "--las-stream-input-len", "4..9",
            "--las-stream-output-len", "30", "--las-long", "3", "--las-long-len", "300", "--las-long-output-len", "2",
            "--las-start", "0.25", "--las-interval", "0.5", "--seed", "4"]
    args = bench_serving.parse_args(argv)
    work = bench_serving.make_workload(args)
    assert work == bench_serving.make_workload(bench_serving.parse_args(argv)), "seeded: the same workload again"
    streams, longs = work[:5], work[5:]
    assert [w["role"] for w in work] == ["stream"] * 5 + ["long"] * 3
    assert all(w["arrival_s"] == 0 and 4 <= w["input_len"] <= 9 and w["output_len"] == 30 for w in streams)
    assert [w["arrival_s"] for w in longs] == [0.25, 0.75, 1.25] and all(w["output_len"] == 2 for w in longs)
    tokenizer = Tokenizer.from_file(str(ROOT / "minioverlap" / "checkpoints" / "tiny" / "tokenizer.json"))
    for w in longs:
        n = len(tokenizer.encode(w["prompt"]).ids)
        assert n == w["input_len"] and 284 <= n <= 300, "the tokens the server will count, near the length asked"
        assert len(w["prompt"].split()) < 300, "the book's words are longer than a token"
    warm = bench_serving.warmup_request(args, work)
    assert warm["role"] == "long" and warm["prompt"] not in {w["prompt"] for w in work}
    assert 284 <= warm["input_len"] <= 300

    ids = bench_serving.make_workload(args, vocab_size=50)
    assert [len(w["prompt"]) for w in ids[5:]] == [300] * 3 and all(10 <= t < 50 for w in ids for t in w["prompt"])

    results = [{"error": None, "ttft_s": 0.01, "latency_s": 0.3, "start_s": 0.0, "itl_s": [0.01, 0.2],
                "output_tokens": 3, "chunks": 3, "prompt_tokens": 9, "cached_tokens": 0}] * 5
    results += [{"error": None, "ttft_s": t, "latency_s": t + 0.01, "start_s": s, "itl_s": [0.01],
                 "output_tokens": 2, "chunks": 2, "prompt_tokens": 300, "cached_tokens": 0}
                for t, s in ((0.1, 0.25), (0.2, 0.75), (0.3, 1.25))]
    figures = bench_serving.aggregate("overlap", results, work, 2.0)
    assert figures["stream_itl_ms_max"] == pytest.approx(200) and figures["stream_itl_ms_median"] == pytest.approx(105)
    assert figures["long_ttft_ms_median"] == pytest.approx(200), "the long prompts' TTFT alone"
    assert figures["long_itl_ms_median"] == pytest.approx(10), "the long prompts' own gaps"
    assert figures["itl_ms_median"] == pytest.approx(10), "every request's gaps, the long prompts' too"
    assert bench_serving.late_long_prompts(work, results) == 2, "two came after the streams had ended"
    assert "stream_itl_ms_median" not in bench_serving.aggregate("overlap", results[:5], [{"output_len": 3}] * 5, 1.0)


def longest_common_prefix(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def test_a_shared_prefix_workload_gives_each_group_exactly_its_system_prompts_tokens():
    argv = ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
            "--gsp-system-prompt-len", "40", "--gsp-question-len", "6", "--gsp-output-len", "5", "--request-rate", "10",
            "--seed", "2"]
    args = bench_serving.parse_args(argv)
    work = bench_serving.make_workload(args)
    assert work == bench_serving.make_workload(bench_serving.parse_args(argv)), "seeded: the same workload again"
    assert work != bench_serving.make_workload(bench_serving.parse_args([*argv[:-1], "3"]))
    assert len(work) == 12 and sorted(w["group"] for w in work) == [0] * 4 + [1] * 4 + [2] * 4
    groups = [w["group"] for w in work]
    assert groups != sorted(groups), "shuffled, as SGLang's: the groups interleave"
    arrivals = [w["arrival_s"] for w in work]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(set(arrivals)) == 12
    assert all((w["system_len"], w["question_len"], w["input_len"], w["output_len"]) == (40, 6, 46, 5) for w in work)

    tokenizer = Tokenizer.from_file(str(ROOT / "minioverlap" / "checkpoints" / "tiny" / "tokenizer.json"))
    prefixes = []
    for g in range(3):
        prompts = [w["prompt"] for w in work if w["group"] == g]
        parts = [p.split("\n\n") for p in prompts]
        assert all(len(part) == 2 for part in parts), "a system prompt, a blank line, a question"
        (system,), questions = {part[0] for part in parts}, [part[1] for part in parts]
        assert len(system.split()) == 40 and all(len(q.split()) == 6 for q in questions)
        assert len(set(questions)) == 4, "each request its own question"
        ids = [tokenizer.encode(p).ids for p in prompts]
        shared = tokenizer.encode(system).ids + tokenizer.encode("\n\nx").ids[:-1]    # the blank line's tokens
        assert all(i[:len(shared)] == shared for i in ids), "the system prompt tokenizes alike before any question"
        assert longest_common_prefix(ids) == len(shared), "and the group shares exactly those tokens"
        prefixes.append(shared)
    assert longest_common_prefix(prefixes) < 16, "another group's system prompt: not a page in common"

    ordered = bench_serving.make_workload(bench_serving.parse_args([*argv, "--gsp-ordered"]))
    assert [w["group"] for w in ordered] == sorted(groups), "--gsp-ordered: group after group"
    assert sorted(w["prompt"] for w in ordered) == sorted(w["prompt"] for w in work)

    ids = bench_serving.make_workload(args, vocab_size=50)
    for g in range(3):
        prompts = [w["prompt"] for w in ids if w["group"] == g]
        assert all(len(p) == 46 and all(10 <= t < 50 for t in p) for p in prompts)
        assert longest_common_prefix(prompts) >= 40 and len({tuple(p[:40]) for p in prompts}) == 1
        assert len({tuple(p[40:]) for p in prompts}) == 4

    warm = bench_serving.warmup_request(args, work)
    assert warm["group"] is None and warm["input_len"] == 46 and warm["prompt"] not in {w["prompt"] for w in work}
    assert all(not w["prompt"].startswith(warm["prompt"].split("\n\n")[0]) for w in work), "no group's prefix"
    assert bench_serving.warmup_request(bench_serving.parse_args([]), [{"prompt": "a"}]) == {"prompt": "a"}


def test_each_dataset_takes_its_own_options():
    for argv in (["--dataset", "generated-shared-prefix", "--num-requests", "4"],
                 ["--dataset-name", "generated-shared-prefix", "--input-len", "4"],
                 ["--gsp-num-groups", "2"], ["--gsp-ordered"], ["--gsp-range-ratio", "1.5"]):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(argv)
    args = bench_serving.parse_args(["--dataset-name", "generated-shared-prefix", "--gsp-range-ratio", "0.5"])
    assert (args.dataset, args.gsp_num_groups, args.gsp_range_ratio, args.gsp_ordered) == (
        "generated-shared-prefix", 8, 0.5, False)
    work = bench_serving.make_workload(args)
    assert len(work) == 64 and all(80 <= w["system_len"] <= 160 and 8 <= w["question_len"] <= 16
                                   and 16 <= w["output_len"] <= 32 for w in work)
    assert len({w["system_len"] for w in work if w["group"] == 0}) == 1, "a system prompt's length: once per group"
    assert (bench_serving.parse_args([]).num_requests, bench_serving.parse_args([]).input_len) == (64, (8, 64))


def test_the_hit_rate_is_the_cached_share_of_the_completed_requests_prompt_tokens():
    def result(prompt: int, cached: int | None, error: str | None = None) -> dict:
        return {"error": error, "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": 4, "chunks": 4,
                "ttft_s": 0.01, "latency_s": 0.05, "itl_s": [0.01] * 3}
    work = [{"output_len": 4}] * 4
    results = [result(100, 0), result(200, 160), result(100, 96), result(300, None, error="HTTP 500")]
    figures = bench_serving.aggregate("normal+cache", results, work, 1.0)
    assert (figures["input_tokens"], figures["cached_tokens"]) == (400, 256), "the failed request counts for nothing"
    assert figures["hit_rate"] == pytest.approx(256 / 400)
    assert bench_serving.aggregate("normal", [result(100, 0)] * 2, work[:2], 1.0)["hit_rate"] == 0
    unreported = bench_serving.aggregate("url", [result(100, 0), result(100, None)], work[:2], 1.0)
    assert unreported["hit_rate"] is None and unreported["cached_tokens"] is None, "a server that does not say"
    assert bench_serving.hit_rate([]) == (None, None)


def test_a_token_id_workload_is_seeded_and_inside_the_vocabulary():
    args = bench_serving.parse_args(["--num-requests", "5", "--input-len", "3..7", "--output-len", "2..4",
                                     "--request-rate", "10", "--seed", "3"])
    work = bench_serving.make_workload(args, vocab_size=50)
    assert work == bench_serving.make_workload(args, vocab_size=50)
    assert all(len(w["prompt"]) == w["input_len"] and 3 <= w["input_len"] <= 7 for w in work)
    assert all(10 <= t < 50 for w in work for t in w["prompt"]) and len({t for w in work for t in w["prompt"]}) > 5
    assert isinstance(bench_serving.make_workload(args)[0]["prompt"], str)
    assert bench_serving.token_id_vocab("tiny") is None, "the shipped model has a tokenizer: text prompts"
