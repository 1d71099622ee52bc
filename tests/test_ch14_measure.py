"""Chapter 14: measuring what overlap buys. The recorded H200 run the chapter explains is consistent and the
example prints what it says; the two changes its profile asked for hold: RMSNorm is the same arithmetic in
one call, and RoPE's angles reach every layer already in the model's dtype (cast once a step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_example
from minioverlap import LLM, SamplingParams
from minioverlap.device.trace import Trace, TraceEvent
from minioverlap.model import qwen3
from minioverlap.model.qwen3 import RMSNorm

RUN = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "14-h200.json"


def recorded() -> dict:
    run = json.loads(RUN.read_text())
    return {(r["shape"], r["batch"], r["system"]): r for r in run["results"]}


def test_every_recorded_row_is_consistent_with_its_own_measurements():
    """tokens/s x ms/step = batch x 1000 (both from one wall time), x HBM = ms/step over the bound, and the
    bound is the weights read per step over the copy bandwidth (4.1-4.3 TB/s on an H200)."""
    rows = recorded()
    assert {s for s, _, _ in rows} == {"0.6b", "8b"} and {b for _, b, _ in rows} >= {1, 4, 16}
    for (shape, batch, system), r in rows.items():
        assert r["tok_s"] * r["ms_step"] == pytest.approx(batch * 1000, rel=5e-3), (shape, batch, system)
        assert r["x_hbm"] == pytest.approx(r["ms_step"] / r["hbm_ms"], rel=5e-3)
        assert 4.0 < r["weights_GB"] / r["hbm_ms"] < 4.4, "GB per ms = TB/s"
        minioverlap = not system.startswith("hf-")
        assert (r["gap_ms"] is not None) == minioverlap and (r["cpu_ms"] is not None) == minioverlap


def test_the_recorded_tiny_run_shows_what_mtp_adds():
    """The tiny model's run (bf16, its trained MTP layer, k = 3): tokens/s and ms per token agree; each
    MTP row accepted 2.5-3.1 tokens per pass (accept length) and beats plain decoding in the same loop;
    the host outlasts the device's plain step, so the overlap loop's gap stays above 0.3 ms at batch 1, and
    a verify step doubles the host's work."""
    run = json.loads(RUN.with_name("14-h200-tiny-mtp.json").read_text())
    rows = {(r["batch"], r["system"]): r for r in run["results"]}
    assert {r["shape"] for r in run["results"]} == {"tiny"} and {b for b, _ in rows} == {1, 4, 16}
    for (batch, system), r in rows.items():
        assert r["tok_s"] * r["ms_step"] == pytest.approx(batch * 1000, rel=5e-3), (batch, system)
        assert ("accept" in r) == system.endswith("-mtp")
    for batch in (1, 4, 16):
        for loop in ("normal", "overlap"):
            mtp, plain = rows[batch, f"{loop}-graphs-mtp"], rows[batch, f"{loop}-graphs"]
            assert mtp["mtp"] == 3 and 2.5 <= mtp["accept"] <= 3.1
            assert mtp["tok_s"] > plain["tok_s"], (batch, loop)
    assert rows[1, "overlap-graphs"]["gap_ms"] > 0.3
    assert rows[1, "normal-graphs-mtp"]["cpu_ms"] >= 2 * rows[1, "normal-graphs"]["cpu_ms"], "the host's work doubles"

def test_the_recorded_gaps_are_what_the_chapter_says():
    """With graphs, the overlap loop's median GPU gap is at most 0.03 ms at every batch; the normal loop's
    is the host's work between steps, at least 0.3 ms, and it grows with the batch."""
    rows = recorded()
    for (shape, batch, system), r in rows.items():
        if system == "overlap-graphs":
            assert r["gap_ms"] <= 0.03, (shape, batch)
        if system == "normal-graphs":
            assert r["gap_ms"] >= 0.3, (shape, batch)
    for shape in ("0.6b", "8b"):
        gaps = [r["gap_ms"] for (s, b, system), r in sorted(rows.items()) if s == shape and system == "normal-graphs"]
        assert gaps == sorted(gaps)


@pytest.mark.process
def test_the_example_prints_each_configuration_s_gain_from_the_record():
    out = run_example("examples/ch14_measure.py")
    rows = recorded()
    assert "the recorded run: NVIDIA H200, bf16, 64-token prompts, 128 new tokens" in out
    for (shape, batch, system), overlap in rows.items():
        if system != "overlap-graphs":
            continue
        normal, compiled = rows[shape, batch, "normal-graphs"], rows[shape, batch, "hf-compile"]
        cells = [shape, str(batch), f"{overlap['ms_step']:.2f}", f"{normal['gap_ms']:.3f}",
                 f"{overlap['tok_s'] / normal['tok_s']:.2f}x", f"{overlap['tok_s'] / compiled['tok_s']:.2f}x"]
        line = next((row for row in out.splitlines() if row.startswith(f"│ {shape} ") and f"│ {batch} " in row), "")
        assert all(cell in line for cell in cells), (cells, line)
    if not torch.cuda.is_available():
        assert "no CUDA device here: the live part needs one" in out


def test_the_host_s_work_per_step_by_hand():
    """Two steps of the normal loop, times in microseconds. A phase lasts from the event before it to its
    own; the first schedule has none before it and is not counted. Means: schedule 50 (step 2 only),
    launch 100, process (100 + 150) / 2 = 125, reply 50; wait (1000) is not the host's work: 0.325 ms."""
    trace = Trace()
    times = [("schedule", 1, 0), ("launch", 1, 100), ("wait", 1, 1100), ("process", 1, 1200), ("reply", 1, 1250),
             ("schedule", 2, 1300), ("launch", 2, 1400), ("wait", 2, 2400), ("process", 2, 2550), ("reply", 2, 2600)]
    trace.extend(TraceEvent(kind, step, us * 1000, (0,)) for kind, step, us in times)
    assert trace.host_ms_per_step() == pytest.approx(0.325)
    trace.append(TraceEvent("wait", 3, 9_600_000, (0,)))               # a long wait changes nothing
    assert trace.host_ms_per_step() == pytest.approx(0.325)


def test_an_engine_s_host_work_is_every_phase_but_the_wait():
    llm = LLM(model="tiny", device="cpu", max_running=2)
    llm.generate(["def fibonacci(n):", "class Stack:"], SamplingParams(max_tokens=8, ignore_eos=True))
    phases = llm.trace.phase_times_us()
    assert set(phases) == {"schedule", "launch", "wait", "process", "reply"}
    assert llm.trace.host_ms_per_step() == pytest.approx(sum(phases.values()) / 1e3 - phases["wait"] / 1e3)


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 32)])
def test_rmsnorm_is_the_formula_bit_for_bit_in_fp32(shape):
    """x / sqrt(mean(x^2) + eps) * weight, computed by hand: equal to the last bit in fp32 (PyTorch's
    rms_norm does the same operations in the same order, in one call)."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
        x = torch.randn(*shape)
        assert torch.equal(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_rope_s_angles_reach_every_layer_in_the_model_s_dtype(monkeypatch):
    """In a bf16 model every call of apply_rope gets cos and sin already in bf16 (cast once a step, not
    twice per call), and the tokens are those of the same model with the casts left to apply_rope."""
    seen, apply_rope = [], qwen3.apply_rope
    monkeypatch.setattr(qwen3, "apply_rope", lambda x, cos, sin: seen.append((cos.dtype, sin.dtype)) or apply_rope(x, cos, sin))
    llm = LLM(model="tiny", device="cpu", dtype="bfloat16", max_running=1)
    got = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=6))[0].token_ids
    layers = llm.config.num_hidden_layers
    assert len(seen) >= 2 * layers * 6 and set(seen) == {(torch.bfloat16, torch.bfloat16)}

    def angles_in_fp32(self, input_ids, positions, ctx):
        """The forward pass of chapter 01: fp32 angles, each apply_rope casting its own."""
        cos, sin = qwen3.rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    monkeypatch.setattr(qwen3.Qwen3ForCausalLM, "forward", angles_in_fp32)
    fresh = LLM(model="tiny", device="cpu", dtype="bfloat16", max_running=1)
    assert fresh.generate(["def fibonacci(n):"], SamplingParams(max_tokens=6))[0].token_ids == got
