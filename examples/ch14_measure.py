"""Chapter 14: what overlap buys on a GPU, measured beside transformers and the HBM bound.

Run from the repository root:  python examples/ch14_measure.py

Part 1 reads chapters/figures/14-h200.json, the run of tools/bench.py that the chapter explains, and prints
for each model shape and batch size, all with CUDA graphs on: the decode step against the HBM bound, the
normal loop's GPU gap beside the host's CPU time per step, what the overlap loop gains, and minioverlap's
tokens/s against transformers with a static cache and torch.compile. Part 2, on a GPU only, measures the
tiny model the same way, live.
"""

import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams

RUN = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "14-h200.json"
console = Console(width=120)


def recorded() -> None:
    run = json.loads(RUN.read_text())
    rows = {(r["shape"], r["batch"], r["system"]): r for r in run["results"]}
    console.rule(f"the recorded run: {run['device']}, bf16, {run['prompt']}-token prompts, {run['tokens']} new tokens")
    table = Table("shape", "batch", "bound ms", "step ms", "x bound", "normal gap ms", "host ms/step",
                  "overlap gain", "x hf-compile")
    for shape, batch in dict.fromkeys((s, b) for s, b, _ in rows):
        normal, overlap = rows.get((shape, batch, "normal-graphs")), rows.get((shape, batch, "overlap-graphs"))
        compiled = rows.get((shape, batch, "hf-compile"))
        if normal is None or overlap is None:
            continue
        vs_hf = f"{overlap['tok_s'] / compiled['tok_s']:.2f}x" if compiled else "-"
        table.add_row(shape, str(batch), f"{overlap['hbm_ms']:.2f}", f"{overlap['ms_step']:.2f}",
                      f"{overlap['x_hbm']:.2f}", f"{normal['gap_ms']:.3f}", f"{normal['cpu_ms']:.2f}",
                      f"{overlap['tok_s'] / normal['tok_s']:.2f}x", vs_hf)
    console.print(table)
    console.print("bound: the HBM bound of a step; step: the overlap loop's step; normal gap: the normal loop's median "
                  "GPU gap; host ms/step: the normal loop's host work per step; overlap gain: the overlap loop's tokens/s "
                  "over the normal loop's; x hf-compile: the overlap loop's tokens/s over transformers compiled's",
                  highlight=False)


def live(batch: int, tokens: int = 64) -> None:
    prompts = [[5 + i, 6, 7, 8] * 4 for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = LLM(device="cuda", dtype="float32", overlap=overlap, max_running=batch)
        llm.generate(prompts, params)                                  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        results[overlap] = (batch * tokens / (time.perf_counter() - start), statistics.median(llm.trace.gpu_gaps_ms()),
                            llm.trace.host_ms_per_step())
    (n_tps, n_gap, n_cpu), (o_tps, o_gap, _) = results[False], results[True]
    console.print(f"batch {batch:2d}: normal {n_tps:6.0f} tok/s, GPU gap {n_gap:.3f} ms, host {n_cpu:.3f} ms/step; "
                  f"overlap {o_tps:6.0f} tok/s ({o_tps / n_tps:.2f}x), GPU gap {o_gap:.3f} ms", highlight=False)


recorded()
console.rule("the tiny model, live")
if torch.cuda.is_available():
    for batch in (1, 16):
        live(batch)
else:
    console.print("no CUDA device here: the live part needs one (`python tools/bench.py --report "
                  "chapters/figures/14-h200.json` prints the whole recorded table)", highlight=False)
