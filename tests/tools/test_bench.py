"""tools/bench.py on a CPU: the report of a recorded run, merging runs, and the argument checks.

The fixtures tests/tools/fixtures/bench_format.json (the batch table) and bench_first_token.json (the
--first-token sweep) are hand-written in the format a GPU run records (their "note" says so); the
benchmark itself needs a CUDA GPU and is not run here.
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
FIRST_TOKEN = FIXTURE.with_name("bench_first_token.json")


def run_bench(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=cwd, env=env,
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


def cells(text: str, *parts: str) -> list[str]:
    """The cells of the one table line that holds every part."""
    return [c.strip() for c in line_of(text, *parts).strip().strip("│").split("│")]


def test_rows_from_hand_made_samples_have_the_hand_computed_bound_ratios_and_tokens_per_second(capsys):
    """bench.row on samples (wall s, GPU gap, CPU ms/step, accept, decode CPU ms, first s) made by hand,
    batch 4 of 128 tokens, 1.5 GB of weights at 3 TB/s: the bound is 1.5e9 / 3e12 = 0.5 ms whatever the
    batch; overlap-graphs' median wall 0.256 s is 2.0 ms a step, 4x the bound, 4 * 128 / 0.256 = 2000 tok/s; hf-compile's 0.512 s
    is 1000 tok/s, so the report shows overlap-graphs at 2.00x it; MTP's 0.128 s is 1.0 ms a token.
    Medians skip the probes that gave None; a system with none has none."""
    bench = load_bench()
    tokens, weight_bytes, bw = 128, 1_500_000_000, 3e12
    samples = {
        "hf-compile": [(0.6, None, None, None, None, None), (0.512, None, None, None, None, None),
                       (0.5, None, None, None, None, None)],
        "overlap-graphs": [(0.4, 0.01, 0.5, None, 0.3, None), (0.256, None, 0.7, None, 0.5, None),
                           (0.25, 0.03, 0.6, None, 0.4, None)],
        "overlap-graphs-mtp": [(0.128, 0.02, 0.9, 2.5, 0.8, None), (0.2, 0.02, 1.1, 3.0, 0.7, None),
                               (0.1, 0.02, 1.0, 2.0, None, None)],
    }
    rows = {name: bench.row("0.6b", 4, name, s, tokens, weight_bytes, bw, 3) for name, s in samples.items()}
    common = {"shape": "0.6b", "batch": 4, "hbm_ms": 0.5, "weights_GB": 1.5, "bound_ms": None, "x_bound": None}
    assert rows["hf-compile"] == {**common, "system": "hf-compile", "tok_s": 1000.0, "ms_step": 4.0, "x_hbm": 8.0,
                                  "ms_first": None, "ms_decode": None,
                                  "gap_ms": None, "cpu_ms": None, "cpu_ms_decode": None}
    assert rows["overlap-graphs"] == {**common, "system": "overlap-graphs", "tok_s": 2000.0, "ms_step": 2.0,
                                      "x_hbm": 4.0, "ms_first": None, "ms_decode": None, "gap_ms": 0.02, "cpu_ms": 0.6, "cpu_ms_decode": 0.4}
    assert rows["overlap-graphs-mtp"] == {**common, "system": "overlap-graphs-mtp", "tok_s": 4000.0, "ms_step": 1.0,
                                          "x_hbm": 2.0, "ms_first": None, "ms_decode": None, "gap_ms": 0.02, "cpu_ms": 1.0, "cpu_ms_decode": 0.75,
                                          "mtp": 3, "accept": 2.5}
    # the datasheet's bound beside it: 1.5e9 / 4.8e12 = 0.3125 ms, so 2.0 ms a step is 6.4x it
    sheet = bench.row("0.6b", 4, "overlap-graphs", samples["overlap-graphs"], tokens, weight_bytes, bw, 3, 4.8e12)
    assert (sheet["bound_ms"], sheet["x_bound"]) == (0.3125, 6.4)
    assert bench.datasheet_bps("NVIDIA H200") == 4.8e12 and bench.datasheet_bps("a hand-made record") is None
    record = {"device": "a hand-made record", "torch": "-", "transformers": "-", "copy_GBps": 3000.0,
              "prompt": 64, "tokens": tokens, "results": list(rows.values())}
    bench.report(record)
    out = capsys.readouterr().out
    assert "1.50 GB read per step, HBM bound 0.500 ms/step" in out
    assert cells(out, "│ hf-compile ") == ["4", "hf-compile", "1000", "4.00", "8.00", "1.00x", "-", "-", "-"]
    assert cells(out, "│ overlap-graphs ") == ["4", "overlap-graphs", "2000", "2.00", "4.00", "2.00x", "0.020", "0.600", "-"]
    assert cells(out, "│ overlap-graphs-mtp") == ["4", "overlap-graphs-mtp k=3", "4000", "1.00", "2.00", "4.00x", "0.020",
                                                "1.000", "2.50"]


def test_a_run_of_the_first_token_alone_separates_the_prefill_from_the_decode_step(capsys):
    """Samples whose last field is the wall time of a run of the first token alone: a 128-token run of
    0.27 s whose first token takes 0.016 s adds (0.27 - 0.016) / 127 = 2.0 ms a further token, where
    ms_step (0.27 / 128) spreads the prefill over the run. The report shows both, and the host's work of a
    decode step beside its mean."""
    bench = load_bench()
    samples = [(0.3, 0.01, 0.9, None, 0.5, 0.02), (0.27, 0.01, 0.8, None, 0.4, 0.016), (0.26, 0.01, 0.7, None, 0.3, 0.01)]
    r = bench.row("8b", 16, "overlap-kernels", samples, 128, 1_500_000_000, 3e12, 3)
    assert (r["ms_first"], r["ms_decode"], r["ms_step"]) == (16.0, 2.0, 2.1094)
    bench.report({"device": "a hand-made record", "torch": "-", "transformers": "-", "copy_GBps": 3000.0,
                  "prompt": 64, "tokens": 128, "results": [r]})
    assert cells(capsys.readouterr().out, "│ overlap-kernels") == [
        "16", "overlap-kernels", "7585", "2.11", "16.0", "2.00", "4.22", "-", "0.010", "0.800", "0.400"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed: no plot")
def test_report_writes_its_plot_beside_the_json_or_to_png_never_into_the_working_directory(tmp_path):
    runs, cwd = tmp_path / "runs", tmp_path / "cwd"
    runs.mkdir()
    cwd.mkdir()
    record = runs / "h200.json"
    record.write_text(FIXTURE.read_text())
    done = run_bench("--report", str(record), cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert (runs / "h200.png").read_bytes().startswith(b"\x89PNG") and f"wrote {runs / 'h200.png'}" in done.stdout
    assert list(cwd.iterdir()) == []
    done = run_bench("--report", str(record), "--png", str(tmp_path / "elsewhere.png"), cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "elsewhere.png").read_bytes().startswith(b"\x89PNG")
    assert list(cwd.iterdir()) == [] and sorted(p.name for p in runs.iterdir()) == ["h200.json", "h200.png"]
    assert load_bench().png_path(load_bench().parse_args([])) == Path("bench.png")    # a run: beside --out


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


def test_the_bound_of_the_tiny_model_counts_its_main_weights_once_and_not_its_mtp_layer():
    bench = load_bench()
    path = bench.make_checkpoint("tiny", Path("unused"))
    h, kv, q, mlp, vocab, layers = 256, 2 * 64, 4 * 64, 768, 4096, 6          # checkpoints/tiny/config.json
    layer = h * q + 2 * h * kv + q * h + 3 * h * mlp + 2 * 64 + 2 * h          # q k v o, gate up down, q/k norm, 2 norms
    assert bench.step_weight_bytes(path) == 2 * (vocab * h + layers * layer + h)   # tied head once, final norm; bf16
    assert bench.has_mtp(path)


def test_tiny_prompts_are_windows_of_the_source_the_same_for_every_call():
    bench = load_bench()
    path = bench.make_checkpoint("tiny", Path("unused"))
    prompts = bench.make_prompts("tiny", path, 4, 64)
    assert prompts == bench.make_prompts("tiny", path, 4, 64) and len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == 64 and all(0 <= t < 4096 for t in p) for p in prompts)
    from minioverlap.model.loader import load_tokenizer
    source = "\n".join(f.read_text() for f in sorted((ROOT / "minioverlap").rglob("*.py")))
    assert all(load_tokenizer(path).decode(p) in source for p in prompts)
    random = bench.make_prompts("8b", path, 2, 16)
    assert [len(p) for p in random] == [16, 16] and max(max(p) for p in random) < 151643


def test_report_shows_the_accept_length_of_the_mtp_rows(tmp_path):
    record = json.loads(FIXTURE.read_text())
    plain = {"shape": "tiny", "batch": 16, "system": "overlap-graphs", "tok_s": 6000.0, "ms_step": 2.6667,
             "hbm_ms": 0.0024, "x_hbm": 1111.1, "gap_ms": 0.001, "cpu_ms": 1.1, "weights_GB": 0.012}
    mtp = {**plain, "system": "overlap-graphs-mtp", "tok_s": 9000.0, "ms_step": 1.7778, "mtp": 3, "accept": 2.71}
    record["results"] += [plain, mtp]
    path = tmp_path / "mtp.json"
    path.write_text(json.dumps(record))
    done = run_bench("--report", str(path), "--png", str(tmp_path / "plot.png"))
    assert done.returncode == 0, done.stderr
    assert "tok/pass" in done.stdout
    assert line_of(done.stdout, "overlap-graphs-mtp k=3", "9000").rstrip("│ ").endswith("2.71")
    assert line_of(done.stdout, " 16 ", "overlap-graphs ", "6000").rstrip("│ ").endswith("-")
    assert done.stdout.count("tok/pass") == 1                   # only the table of the shape with MTP rows


def test_a_decode_step_s_host_work_leaves_out_the_prefill_and_the_waits():
    """decode_host_ms on a hand-made trace: step 1 (the prefill) spends 9 ms launching, steps 2-4 spend 0.1
    + 0.2 + 0.1 + 0.1 ms in schedule, launch, process and reply, besides waits of 5 ms (step 4's launch
    takes 0.3): the median over steps 2-4 is 0.5 ms, where the mean of every phase counts the prefill."""
    from minioverlap.device.trace import Trace, TraceEvent
    bench, trace, t = load_bench(), Trace(), 0
    for step, launch in ((1, 9.0), (2, 0.2), (3, 0.2), (4, 0.3)):
        for kind, ms in (("schedule", 0.1), ("launch", launch), ("wait", 5.0), ("process", 0.1), ("reply", 0.1)):
            t += round(ms * 1e6)
            trace.append(TraceEvent(kind, step, t, (0,)))
    assert bench.decode_host_ms(trace) == pytest.approx(0.5)
    assert trace.host_ms_per_step() > 2.0
    assert bench.decode_host_ms(Trace()) is None


def test_the_minioverlap_systems_run_and_probe_with_the_engine_on_a_cpu(monkeypatch):
    """The bench's minioverlap systems, with the engine moved to the CPU (no graphs, no GPU gaps): each
    serves the prompts to exactly --tokens new tokens; an -mtp system probes its accept length, the
    tokens over the passes of its last run (the prefills and the verify steps), and a plain one none."""
    import minioverlap
    bench = load_bench()
    real = minioverlap.LLM
    monkeypatch.setattr(minioverlap, "LLM", lambda **kw: real(**{**kw, "device": "cpu", "dtype": "float32",
                                                                 "cuda_graphs": False}))
    path = bench.make_checkpoint("tiny", Path("unused"))
    prompts = bench.make_prompts("tiny", path, 2, 16)
    for name in ("normal-graphs", "overlap-graphs-mtp"):
        run, probe = bench.minioverlap_system(path, name, prompts, 12, 3)
        run(1)                                                   # the first token alone: the prefill's
        run()
        gap, cpu, accept, decode_cpu = probe()
        assert gap is None and cpu > 0 and decode_cpu > 0
        assert (accept is None) == (name == "normal-graphs")
    llm = real(model=str(path), mtp_steps=3, max_running=2)
    outs = llm.generate(prompts, minioverlap.SamplingParams(max_tokens=12, ignore_eos=True))
    assert accept == 24 / sum(o.verify_steps for o in outs) and accept > 1


@pytest.mark.parametrize("name, loop, graphs, kernels, mtp", [
    ("normal-eager", False, False, False, 0), ("overlap-graphs", True, True, False, 0),
    ("normal-kernels", False, True, True, 0), ("overlap-kernels-mtp", True, True, True, 3)])
def test_each_system_name_picks_its_loop_its_graphs_and_its_path(monkeypatch, name, loop, graphs, kernels, mtp):
    """-eager and -graphs run the reference path (chapter 14's systems, measured as they were); -kernels
    runs chapter 15's fast path, with graphs."""
    import minioverlap
    seen = {}
    monkeypatch.setattr(minioverlap, "LLM", lambda **kw: seen.update(kw))
    load_bench().minioverlap_system(Path("ckpt"), name, [[1, 2, 3]], 8, 3)
    assert (seen["overlap"], seen["cuda_graphs"], seen["kernels"], seen["mtp_steps"]) == (loop, graphs, kernels, mtp)


def test_the_host_profile_ranks_the_functions_of_a_step_by_their_own_time(monkeypatch, capsys):
    """profile_host on the CPU engine (the reference path, no graphs): the trace's host work per step and the
    functions with the most time of their own, costliest first, the scheduler's among them; the report
    prints them."""
    import minioverlap
    bench = load_bench()
    real = minioverlap.LLM
    monkeypatch.setattr(minioverlap, "LLM", lambda **kw: real(**{**kw, "device": "cpu", "dtype": "float32",
                                                                 "cuda_graphs": False, "kernels": False}))
    path = bench.make_checkpoint("tiny", Path("unused"))
    prof = bench.profile_host("tiny", path, 8, tokens=6, top=10)
    times = [t["ms_per_step"] for t in prof["top"]]
    assert prof["host_ms_per_step"] > 0 and len(times) == 10 and times == sorted(times, reverse=True) and times[0] > 0
    assert all(t["calls_per_step"] > 0 for t in prof["top"])
    row = bench.row("tiny", 1, "overlap-kernels", [(0.1, 0.001, 0.5, None, 0.4, None)], 6, 1_000_000, 4e12, 3)
    bench.report({"device": "-", "torch": "-", "transformers": "-", "copy_GBps": 4000.0, "prompt": 8, "tokens": 6,
                  "results": [row], "profile_host": {"tiny": {"plain": prof}}})
    out = capsys.readouterr().out
    assert f"fast path, plain: {prof['host_ms_per_step']:.3f} ms of host work a step" in out
    assert prof["top"][0]["function"][:40] in out


def test_report_prints_the_profile_of_each_path(capsys):
    bench = load_bench()
    row = bench.row("0.6b", 1, "overlap-kernels", [(0.1, 0.001, 0.5, None, 0.4, None)], 100, 1_000_000_000, 4e12, 3, 4.8e12)
    top = [{"name": "split_kernel", "ms_per_step": 0.25, "per_step": 28.0}]
    record = {"device": "NVIDIA H200", "torch": "-", "transformers": "-", "copy_GBps": 4000.0, "prompt": 64,
              "tokens": 100, "results": [row],
              "profile": {"0.6b": {"kernels_per_step": 1053.0, "gpu_ms_per_step": 2.8, "top": top}},
              "profile_kernels": {"0.6b": {"kernels_per_step": 382.0, "gpu_ms_per_step": 1.4, "top": top}}}
    bench.report(record)
    out = capsys.readouterr().out
    assert "a graphed decode step at batch 1: 1053 kernels, 2.800 ms of GPU time" in out
    assert "a graphed decode step at batch 1 on the fast path: 382 kernels, 1.400 ms of GPU time" in out
    assert "datasheet bound 0.208" in out and cells(out, "│ overlap-kernels")[4:6] == ["4.00", "4.80"]


@pytest.mark.parametrize("args, field", [
    (["--shapes", "7b"], "--shapes"), (["--systems", "vllm"], "--systems"), (["--batches", "1", "0"], "--batches"),
    (["--tokens", "0"], "--tokens"), (["--repeats", "0"], "--repeats"), (["--mtp", "0"], "--mtp"),
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


def test_report_of_a_first_token_sweep_alone_gives_the_ratio_to_hf_eager_and_the_chunks(tmp_path):
    """The fixture has no batch table: the report prints the sweep's table and exits 0, with no plot.
    8b at 16384 tokens: overlap-kernels 430 ms against hf-eager's 656 -> 0.66x; its chunks of 2048 tokens,
    58.0 ms the first and 70.0 the last -> 1.21x; at 1024 tokens, run whole only, 60 / 95 -> 0.63x."""
    record = json.loads(FIRST_TOKEN.read_text())
    assert record["note"] == "format fixture for tests, not a measurement" and "results" not in record
    done = run_bench("--report", str(FIRST_TOKEN), "--png", str(tmp_path / "plot.png"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Qwen3-8b shape, random weights, bf16: the first token (the prefill) by prompt length" in out
    assert "GB read per step" not in out and not (tmp_path / "plot.png").exists() and "wrote" not in out
    assert cells(out, "16384", "overlap-kernels") == ["16384", "overlap-kernels", "430.0", "0.66x", "58.0", "70.0", "1.21x"]
    assert cells(out, "16384", "overlap-graphs") == ["16384", "overlap-graphs", "905.0", "1.38x", "62.0", "136.4", "2.20x"]
    assert cells(out, "16384", "hf-eager") == ["16384", "hf-eager", "656.0", "1.00x", "-", "-", "-"]
    assert cells(out, "1024", "overlap-kernels") == ["1024", "overlap-kernels", "60.0", "0.63x", "-", "-", "-"]
    assert "(sdpa attention)" in out and "in chunks of 2048 tokens" in out


def test_report_of_both_modes_prints_both_tables(capsys):
    bench = load_bench()
    record = json.loads(FIXTURE.read_text()) | {"first_token": json.loads(FIRST_TOKEN.read_text())["first_token"][:3]}
    bench.report(record)
    out = capsys.readouterr().out
    assert "15.14 GB read per step" in out and "1.19x" in line_of(out, "overlap-graphs", "262")
    assert cells(out, "1024", "overlap-graphs") == ["1024", "overlap-graphs", "88.0", "0.93x"]   # no chunk columns
    assert "in chunks" not in out


def test_merge_of_first_token_rows_replaces_a_remeasured_row_and_keeps_the_rest():
    bench = load_bench()
    old = json.loads(FIRST_TOKEN.read_text())
    again = dict(old["first_token"][5], ms_first=420.0, chunk_ms=[57.0, 69.0])       # 8b, 16384, overlap-kernels
    longer = dict(old["first_token"][2], prompt=4096, ms_first=150.0)
    new = {**{k: v for k, v in old.items() if k not in ("note", "first_token")}, "torch": "2.12.0",
           "first_token": [again, longer]}
    merged = bench.merge(old, new)
    assert merged["torch"] == "2.12.0" and merged["note"] == old["note"] and "results" not in merged
    keys = [(r["shape"], r["prompt"], r["system"]) for r in merged["first_token"]]
    assert keys == [("8b", 1024, "hf-eager"), ("8b", 1024, "overlap-graphs"), ("8b", 1024, "overlap-kernels"),
                    ("8b", 4096, "overlap-kernels"), ("8b", 16384, "hf-eager"), ("8b", 16384, "overlap-graphs"),
                    ("8b", 16384, "overlap-kernels")]
    assert merged["first_token"][6] == again and merged["first_token"][3] == longer
    assert merged["first_token"][:3] == old["first_token"][:3] and merged["first_token"][4:6] == old["first_token"][3:5]
    with pytest.raises(bench.MergeError, match="device 'NVIDIA H200'"):
        bench.merge(old, {**new, "device": "NVIDIA H100 80GB HBM3"})


def test_a_first_token_sweep_merges_into_a_batch_table_of_the_same_device():
    """The sweep has no prompt length or token count of its own: the batch table's stay, its rows untouched."""
    bench = load_bench()
    table, sweep = json.loads(FIXTURE.read_text()), json.loads(FIRST_TOKEN.read_text())
    merged = bench.merge(table, sweep)
    assert (merged["prompt"], merged["tokens"], merged["hf_attention"]) == (64, 128, "sdpa")
    assert merged["results"] == table["results"] and merged["first_token"] == sweep["first_token"]
    assert bench.merge(merged, {**table, "results": table["results"][:1]})["first_token"] == sweep["first_token"]
    with pytest.raises(bench.MergeError, match="device"):
        bench.merge(table, {**sweep, "device": "NVIDIA A100-SXM4-80GB"})


def test_first_token_rows_and_the_chunk_steps_gpu_ms():
    """first_token_row: the median of the runs; step_ms: each step's span of trace.gpu (ms, in step order),
    one per chunk, or a RuntimeError when the trace has another number of steps."""
    from minioverlap.device.trace import Trace
    bench = load_bench()
    assert bench.first_token_row("8b", 16384, "overlap-kernels", [431.25, 429.5, 430.0], 2048) == {
        "shape": "8b", "prompt": 16384, "system": "overlap-kernels", "ms_first": 430.0,
        "ms_all": [431.25, 429.5, 430.0], "chunk": 2048}
    trace = Trace()
    trace.gpu = {2: (58.5, 120.0), 1: (0.0, 58.0), 3: (120.25, 190.25)}
    assert bench.step_ms(trace, 3) == [58.0, 61.5, 70.0]
    with pytest.raises(RuntimeError, match="a run of 4 chunks has GPU spans of 3 steps"):
        bench.step_ms(trace, 4)


@pytest.mark.parametrize("name, chunk, kernels", [("overlap-kernels", -1, True), ("overlap-graphs", 2048, False)])
def test_a_first_token_engine_takes_the_prompt_whole_or_in_chunks_without_the_prefix_cache(monkeypatch, name, chunk,
                                                                                            kernels):
    import minioverlap
    seen = {}
    monkeypatch.setattr(minioverlap, "LLM", lambda **kw: seen.update(kw))
    load_bench().first_token_engine(Path("ckpt"), name, 32768, chunk)
    assert seen == {"model": "ckpt", "device": "cuda", "dtype": "bfloat16", "overlap": True, "cuda_graphs": True,
                    "kernels": kernels, "max_running": 1, "max_seq_len": 32768 + 1 + 16, "prefix_cache": False,
                    "chunked_prefill_size": chunk}


def test_first_token_arguments_pick_the_sweep_s_systems():
    bench = load_bench()
    args = bench.parse_args(["--first-token", "1024", "16384"])
    assert (args.first_token, args.chunk, args.systems) == ([1024, 16384], 2048, ["hf-eager", "overlap-graphs",
                                                                                  "overlap-kernels"])
    args = bench.parse_args(["--first-token", "4096", "--systems", "overlap-kernels", "hf-eager", "--chunk", "1024"])
    assert (args.systems, args.chunk) == (["overlap-kernels", "hf-eager"], 1024)
    assert bench.parse_args([]).systems == list(bench.SYSTEMS) and bench.parse_args([]).first_token is None


@pytest.mark.parametrize("args, error", [
    (["--first-token", "0"], "argument --first-token: must be an integer >= 1, got '0'"),
    (["--first-token", "1024", "-5"], "argument --first-token: must be an integer >= 1, got '-5'"),
    (["--first-token", "1024", "--chunk", "0"], "argument --chunk: must be an integer >= 1, got '0'"),
    (["--first-token", "1024", "--systems", "overlap-kernels", "hf-compile"],
     "argument --systems: with --first-token, choose from hf-eager, overlap-graphs, overlap-kernels, not 'hf-compile'"),
    (["--first-token", "1024", "--profile"],
     "argument --first-token: not with --profile or --chrome, which profile the batch table's decode steps"),
])
def test_bad_first_token_arguments_exit_2_naming_the_flag(args, error, capsys):
    with pytest.raises(SystemExit) as raised:
        load_bench().main(args)
    assert raised.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ")[1:] == [error]


def test_shape_by_shape_passes_the_sweep_on_to_each_shape_s_process(monkeypatch, tmp_path):
    """Each shape's command, read back by parse_args, is the sweep given for that shape."""
    bench = load_bench()
    commands = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: commands.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    given = ["--shapes", "0.6b", "8b", "--first-token", "1024", "16384", "--chunk", "1024", "--systems",
             "overlap-kernels", "hf-eager", "--repeats", "5", "--out", str(tmp_path / "first.json")]
    assert bench.shape_by_shape(bench.parse_args(given)) is None                  # nothing written: no process ran
    assert [c[:2] for c in commands] == [[sys.executable, bench.__file__]] * 2
    for shape, cmd in zip(("0.6b", "8b"), commands):
        args = bench.parse_args(cmd[2:])
        assert (args.shapes, args.first_token, args.chunk, args.systems, args.repeats, args.out) == (
            [shape], [1024, 16384], 1024, ["overlap-kernels", "hf-eager"], 5, str(tmp_path / "first.json"))
