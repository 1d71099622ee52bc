"""Chapter 15: the fast path's kernels against the PyTorch reference, then the recorded GPU run.

Run from the repository root:  python examples/ch15_kernels.py

Part 1 runs every kernel of minioverlap/kernels on small inputs beside the PyTorch code it replaces and
prints the largest difference next to the tolerance the tests hold it to (on a CPU the kernels run in
Triton's interpreter). Part 2 generates with the tiny model on both paths and compares the tokens.
Part 3 reads chapters/figures/15-h200.json, the run of tools/bench.py that the chapter explains: the
decode step of the Qwen3-8B shape with the Qwen3-0.6B shape's beside it, the first token's time at
batch 16, then the profiles of a step at batch 1 (its kernels on each path, the host's work on the
fast path).
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.engine.attention import window_attention
from minioverlap.kernels.attention import paged_attention
from minioverlap.kernels.elementwise import add_rms_norm, qk_norm_rope, silu_mul
from minioverlap.kernels.kv_store import store_kv
from minioverlap.model.qwen3 import apply_rope, rope_cos_sin

RUN = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "15-h200.json"
console = Console(width=120)
device = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)


def randn(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def tolerance(want: torch.Tensor) -> float:
    """The tests' bf16 tolerance: two roundings of the largest value (at least of 1)."""
    return 2 * 2 ** -7 * max(1.0, want.abs().max().item())


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def attention_case(window: int, lens: list[int], kv_heads: int = 2, group: int = 4, d: int = 64, page: int = 16):
    """Requests whose pages lie in reverse order in the pool (slot = page * page_size + offset)."""
    slots = (max(lens) + window) // page * page + page
    table = torch.zeros(len(lens), slots, dtype=torch.int32)
    for b in range(len(lens)):
        pos = torch.arange(slots)
        table[b] = ((slots // page - 1 - pos // page) * page + pos % page).int()
    positions = torch.cat([torch.arange(n, n + window) for n in lens]).to(device)
    q, k, v = randn(len(lens) * window, kv_heads * group, d), randn(slots, kv_heads, d), randn(slots, kv_heads, d)
    table = table.to(device)
    want = window_attention(q, k, v, table, positions)
    return paged_attention(q, k, v, table, None, positions, window), want


def kernels() -> None:
    console.rule(f"each kernel against the PyTorch reference ({'on the GPU' if device == 'cuda' else 'in the interpreter'}), bf16")
    table = Table("kernel", "case", "max error", "tolerance")
    k_pool, v_pool = randn(40, 2, 64), randn(40, 2, 64)
    k_ref, v_ref, loc, k, v = k_pool.clone(), v_pool.clone(), torch.tensor([7, 0, 31], device=device), randn(3, 2, 64), randn(3, 2, 64)
    k_ref[loc], v_ref[loc] = k, v
    store_kv(k_pool, v_pool, loc, k, v)
    copied = (k_pool - k_ref).abs().max() + (v_pool - v_ref).abs().max()
    cases = [("store_kv", "3 tokens into a pool of 40 slots (a copy)", copied, 0.0)]
    for window, lens in ((1, [0, 40, 100]), (4, [9, 77])):
        got, want = attention_case(window, lens)
        cases.append(("paged_attention", f"{len(lens)} requests, windows of {window}, GQA 4, pages of 16",
                      (got - want).abs().max(), tolerance(want)))
    x, r, w = randn(4, 256), randn(4, 256), randn(256)
    out, _ = add_rms_norm(x, r.clone(), w, 1e-6)
    want = rms(x + r, w)
    cases.append(("add_rms_norm", "4 tokens x 256", (out - want).abs().max(), tolerance(want)))
    qkv, nw = randn(3, 8 * 64), randn(2, 64)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 900], device=device), 64, 1e6)
    q, _, _ = qk_norm_rope(qkv, nw, cos, sin, 4, 2, 1e-6)
    want = apply_rope(rms(qkv[:, :256].view(3, 4, 64), nw[0]), cos.bfloat16(), sin.bfloat16())
    cases.append(("qk_norm_rope", "3 tokens, 4 q heads + 2 k heads of 64", (q - want).abs().max(), tolerance(want)))
    gate_up = randn(3, 2 * 768)
    want = F.silu(gate_up[:, :768]) * gate_up[:, 768:]
    cases.append(("silu_mul", "3 tokens x 768", (silu_mul(gate_up) - want).abs().max(), tolerance(want)))
    for name, case, err, tol in cases:
        table.add_row(name, case, f"{float(err):.4f}", f"{tol:.4f}")
    console.print(table)


def tokens() -> None:
    console.rule("the tiny model: greedy tokens of both paths")
    prompts, params = ["def fibonacci(n):", "class Stack:"], SamplingParams(max_tokens=8, ignore_eos=True)
    for overlap in (False, True):
        ref = [o.token_ids for o in LLM(device=device, overlap=overlap, kernels=False).generate(prompts, params)]
        fast = [o.token_ids for o in LLM(device=device, overlap=overlap, kernels=True).generate(prompts, params)]
        console.print(f"{'overlap' if overlap else 'normal'} loop: reference {ref[0][:4]}..., fast path "
                      f"{fast[0][:4]}...: {'equal' if fast == ref else 'DIFFERENT'}", highlight=False)


def recorded() -> None:
    run = json.loads(RUN.read_text())
    shapes = {"8b": "8B", "0.6b": "0.6B"}                     # the Qwen3-8B shape first, the 0.6B one beside it
    rows = {(r["shape"], r["batch"], r["system"]): r for r in run["results"]}
    console.rule(f"the recorded run: {run['device']}, bf16, {run['prompt']}-token prompts, "
                 f"{run['tokens']} new tokens each")
    for shape, name in shapes.items():
        r = rows[shape, 1, "hf-compile"]
        console.print(f"Qwen3-{name} shape: {r['weights_GB']:.2f} GB of weights a step, datasheet bound "
                      f"{r['bound_ms']:.3f} ms, copy bound {r['hbm_ms']:.3f} ms", highlight=False)
    table = Table("batch", "system", *(f"{name}\n{what}" for name in shapes.values()
                                       for what in ("decode ms", "x bound", "x hf", "host ms")),
                  caption="decode ms: what each token after the first adds, (wall - first token's) / "
                          f"{run['tokens'] - 1}; x bound: over the datasheet bound; x hf: hf-compile's decode step "
                          "over this one; host ms: the host's work a decode step (median); -: not in this run")
    table.columns[1].no_wrap = True
    for shape, batch, system in rows:
        if shape != "8b" or ("0.6b", batch, system) not in rows:
            continue
        cells = []
        for other in shapes:
            o, base = rows[other, batch, system], rows[other, batch, "hf-compile"]
            decode = o.get("ms_decode")
            cells += [number(decode), number(decode and decode / o["bound_ms"]),
                      number(decode and base.get("ms_decode") and base["ms_decode"] / decode, "x"),
                      number(o.get("cpu_ms_decode"))]
        table.add_row(str(batch), system, *cells)
    console.print(table)
    first = {system: rows["8b", 16, system]["ms_first"] for system in ("hf-compile", "overlap-kernels")}
    console.print(f"the first token (the prefill) at batch 16, 8B: hf-compile {first['hf-compile']:.1f} ms, "
                  f"overlap-kernels {first['overlap-kernels']:.1f} ms", highlight=False)
    for key, path in (("profile", "reference"), ("profile_kernels", "fast path")):
        console.print(f"a graphed step at batch 1, {path}: " + "; ".join(
            f"{name} {run[key][shape]['kernels_per_step']:.0f} kernels, {run[key][shape]['gpu_ms_per_step']:.2f} ms"
            for shape, name in shapes.items()) + " of GPU time", highlight=False)
    host = {shape: {kind: f"{p['host_ms_per_step']:.2f} ms" for kind, p in h.items()}
            for shape, h in run["profile_host"].items()}
    console.print("the host's work a step at batch 1 on the fast path, profiled: "
                  + ", ".join(f"{name} {host[shape]['plain']}" for shape, name in shapes.items())
                  + f", tiny {host['tiny']['plain']}, with MTP {host['tiny']['mtp']}", highlight=False)


def number(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


kernels()
tokens()
recorded()
