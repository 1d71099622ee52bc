"""CPU benchmark: minioverlap against transformers' batched `generate`, on the same CPU, in one run.

    python tools/bench_cpu.py                       # 16 requests of 64 new tokens, 3 timed runs each
    python tools/bench_cpu.py --requests 8 --tokens 128 --repeats 5 --threads 1
    python tools/bench_cpu.py --mtp 3               # MTP (3 drafts per step) against plain, batch 1 and 16
    python tools/bench_cpu.py --mtp 3 --device cuda --tokens 128   # the same on a GPU

Each contender serves the same requests with the tiny model in fp32: N different code prompts, each
generating exactly T new tokens (greedy; minioverlap with ignore_eos, transformers with min_new_tokens
= max_new_tokens), so each produces N * T tokens. minioverlap runs both of its loops, the normal loop
(chapter 04) and the overlap loop (chapter 06): a ragged prefill, then one batched decode step per
token. transformers runs the prompts as one left-padded batch with an attention mask. Every contender
is warmed up once, then they take turns for --repeats runs, so a change in the machine's load hits all
alike. The table reports the median wall time of each as tokens/s, the ratios to transformers, and
the median CPU time of the process (which, with one thread, leaves out the time spent waiting for a
core on a busy machine). It also prints the normal loop's mean host time per phase of a step
(llm.trace.phase_times_us()): on a CPU `launch` runs the whole step, as there is no device to queue
the work on.

With --mtp K it measures chapters 09-12 instead: minioverlap with MTP speculative decoding (K drafts
per step) against the same loop without, in the normal loop and in the overlap loop (chapter 12), at
batch 1 and at --requests, taking turns the same way, and prints tokens/s side by side with their
ratio and the accept length (tokens per pass, the prefill's included); besides the ratio of the medians, the median of
each round's own ratio, which a change in the machine's load between rounds does not skew. Greedy: all
four produce the same tokens (checked). On a GPU every engine runs eagerly (cuda_graphs=False), as in
chapters 09-12; `tools/bench.py --shapes tiny` measures MTP with chapter 13's graphs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from minioverlap import LLM, RequestOutput, SamplingParams

PROMPTS = [
    "def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n", "for i in range(10):",
    "def read_lines(path):", "class Point:", "x = [1, 2, 3]\nprint(", "def parse_args(argv):",
    "with open(filename) as f:", "try:\n    import json\nexcept ImportError:", "def __repr__(self):",
    "if __name__ == '__main__':", "class Node:\n    def __init__(self, value):", "def quicksort(items):",
    "while True:\n    line = input()", "def test_add(self):",
]


def run_minioverlap(llm: LLM, prompts: list[list[int]], tokens: int) -> list[RequestOutput]:
    """All prompts at once through the scheduler: one ragged prefill, then one decode step per token
    (with MTP one verify step per accepted window)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    assert all(len(o.token_ids) == tokens for o in outs)
    return outs


def run_transformers(model, prompts: list[list[int]], tokens: int) -> None:
    """One left-padded batch: pad tokens on the left, masked out, so every prompt ends at the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                             min_new_tokens=tokens, max_new_tokens=tokens)
    assert out.shape == (len(prompts), width + tokens)


def timed(run: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def race(runs: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each run up once, then let them take turns `repeats` times, so that a change in the machine's
    load hits every contender alike -> (wall seconds, CPU seconds) of each timed run, by name."""
    for run in runs.values():              # warm-up
        run()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            w, c = timed(run)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


LOOPS = {"normal": False, "overlap": True}


def bench_mtp(args: argparse.Namespace) -> None:
    """MTP with --mtp drafts per step against plain decoding, in both loops, at batch 1 and --requests."""
    k, rows = args.mtp, []
    for batch in sorted({1, args.requests}):
        # prefix_cache=False: every round repeats the prompts; with the cache on, only the first would prefill
        # them (chapters 09-12 measured a prefill in every run); chunked_prefill_size=-1: one prefill step, as then
        engines = {f"{kind} {loop}": LLM(model="tiny", max_running=batch, overlap=overlap, mtp_steps=k * (kind == "mtp"),
                                         device=args.device, dtype="float32", cuda_graphs=False, prefix_cache=False,
                                         chunked_prefill_size=-1)
                   for loop, overlap in LOOPS.items() for kind in ("plain", "mtp")}
        prompts = [engines["plain normal"].encode(p) for p in PROMPTS[:batch]]
        runs = {name: partial(run_minioverlap, llm, prompts, args.tokens) for name, llm in engines.items()}
        outs = {name: run() for name, run in runs.items()}
        assert len({str([o.token_ids for o in got]) for got in outs.values()}) == 1, "greedy MTP changed the tokens"
        wall, cpu = race(runs, args.repeats)
        tok_s = {name: batch * args.tokens / statistics.median(t) for name, t in wall.items()}
        paired = {loop: statistics.median(p / m for p, m in zip(wall[f"plain {loop}"], wall[f"mtp {loop}"]))
                  for loop in LOOPS}                                     # each round's own ratio
        mtp_outs = outs["mtp normal"]
        rows.append({"batch": batch, "accept_length": batch * args.tokens / sum(o.verify_steps for o in mtp_outs),
                     "tokens_per_s": tok_s, "paired_ratio": paired,
                     "wall_s": {name: [round(s, 3) for s in t] for name, t in wall.items()},
                     "cpu_s": {name: [round(s, 3) for s in t] for name, t in cpu.items()}})
    print(f"MTP (k={k}) against plain decoding, {args.tokens} new tokens per request, tiny model, fp32 on "
          f"{args.device}, {torch.get_num_threads()} torch threads, median of {args.repeats} runs each")
    print(f"  {'batch':>5s} {'loop':>8s} {'plain tok/s':>12s} {f'MTP k={k} tok/s':>15s} {'MTP / plain':>12s} "
          f"{'paired':>7s} {'accept length':>14s}")
    for r in rows:
        for loop in LOOPS:
            plain, mtp = r["tokens_per_s"][f"plain {loop}"], r["tokens_per_s"][f"mtp {loop}"]
            print(f"  {r['batch']:5d} {loop:>8s} {plain:12.0f} {mtp:15.0f} {mtp / plain:11.2f}x "
                  f"{r['paired_ratio'][loop]:6.2f}x {r['accept_length']:14.2f}")
    print("  MTP / plain: the ratio of the medians; paired: the median of each round's ratio (the two ran back to "
          "back, so a change in load cancels)")
    print(json.dumps({"mtp_steps": k, "tokens": args.tokens, "repeats": args.repeats,
                      "threads": torch.get_num_threads(),
                      "batches": [{key: ({n: round(v, 3) for n, v in val.items()} if isinstance(val, dict)
                                         and key in ("tokens_per_s", "paired_ratio")
                                         else round(val, 3) if isinstance(val, float) else val)
                                   for key, val in r.items()} for r in rows]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help=f"concurrent requests (at most {len(PROMPTS)})")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, taking turns")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--mtp", type=int, metavar="K",
                        help="instead: MTP with K drafts per step against plain decoding, batch 1 and --requests")
    parser.add_argument("--device", default="cpu",
                        help="with --mtp: where minioverlap runs (cuda: the same race on a GPU, fp32; default cpu)")
    args = parser.parse_args()
    if not 1 <= args.requests <= len(PROMPTS):
        parser.error(f"--requests must be in [1, {len(PROMPTS)}], got {args.requests}")
    if args.mtp is not None and args.mtp < 1:
        parser.error(f"--mtp must be at least 1, got {args.mtp}")
    if args.device != "cpu" and not args.mtp:
        parser.error("--device takes effect with --mtp only (the race with transformers runs on the CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mtp:
        bench_mtp(args)
        return

    # prefix_cache=False: every run repeats the prompts, and transformers, the baseline, computes each again;
    # with the cache on, only minioverlap's first run would prefill them. chunked_prefill_size=-1: the prompts
    # in one prefill step, as transformers runs them (and as chapter 04 recorded)
    whole = dict(max_running=args.requests, prefix_cache=False, chunked_prefill_size=-1)
    loops = {"normal": LLM(model="tiny", overlap=False, **whole), "overlap": LLM(model="tiny", overlap=True, **whole)}
    logging.set_verbosity_error()          # the tiny checkpoint's MTP tensors are reported as unused
    logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(loops["normal"].model_dir), dtype=torch.float32).eval()
    prompts = [loops["normal"].encode(p) for p in PROMPTS[:args.requests]]   # the same token ids for all
    runs = {f"minioverlap {loop}": partial(run_minioverlap, llm, prompts, args.tokens) for loop, llm in loops.items()}
    runs["transformers"] = partial(run_transformers, hf, prompts, args.tokens)

    wall, cpu = race(runs, args.repeats)

    total = args.requests * args.tokens
    tok_s = {name: total / statistics.median(t) for name, t in wall.items()}
    ratios = {loop: tok_s[f"minioverlap {loop}"] / tok_s["transformers"] for loop in loops}
    print(f"{args.requests} requests x {args.tokens} new tokens, tiny model, fp32, {torch.get_num_threads()} "
          f"torch threads, median of {args.repeats} runs each")
    print(f"  {'':20s} {'wall s':>8s} {'tokens/s':>9s} {'CPU s':>8s}")
    for name in runs:
        print(f"  {name:20s} {statistics.median(wall[name]):8.3f} {tok_s[name]:9.0f} {statistics.median(cpu[name]):8.3f}")
    for loop, ratio in ratios.items():
        print(f"  minioverlap {loop} / transformers: {ratio:.2f}x")
    phases = loops["normal"].trace.phase_times_us()
    steps = len({e.step for e in loops["normal"].trace})
    print(f"the normal loop, mean host time per phase of a step ({steps} steps):")
    for kind, us in phases.items():
        print(f"  {kind:9s} {us:9.0f} us")
    print(json.dumps({"requests": args.requests, "tokens": args.tokens, "repeats": args.repeats,
                      "threads": torch.get_num_threads(),
                      "wall_s": {k: [round(s, 3) for s in v] for k, v in wall.items()},
                      "cpu_s": {k: [round(s, 3) for s in v] for k, v in cpu.items()},
                      "tokens_per_s": {k: round(v, 1) for k, v in tok_s.items()},
                      "ratio": {k: round(v, 3) for k, v in ratios.items()},
                      "normal_loop_phase_us": {k: round(v, 1) for k, v in phases.items()}}))


if __name__ == "__main__":
    main()
