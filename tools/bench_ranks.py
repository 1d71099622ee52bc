"""Tensor parallelism and DP attention on this machine's CPU (chapter 20): one rank against two, each loop,
batch 1 and 16.

    python tools/bench_ranks.py                                   # prints the table
    python tools/bench_ranks.py --json chapters/figures/20-cpu-ranks.json

Every case runs the same prompts (bench_cpu.py's 16 code prompts, or the first at batch 1), greedy, each
request exactly --tokens new tokens; it is warmed up once and run --repeats times (the median is kept).
With two ranks each process gets one thread (torch.set_num_threads), so that the two ranks use the two
cores one device's run uses. The table gives tokens a second, the host's time of one iteration, and, on
each rank, the `share` phase: the exchange that opens every iteration, rank 0's inbox broadcast over gloo
(llm.rank_traces(), Trace.phase_times_us), and the `launch` phase, which on a CPU runs the step itself,
its all-reduces included. In the overlap loop the share of iteration N+1 comes after step N's launch and
before its wait: on a GPU the device runs step N meanwhile; in the normal loop it comes after step N is
handled, with the device idle.

The dp2 cases run DP attention over two ranks: each rank serves its own requests (at batch 1, rank 1 runs
the empty batch in every step). Their `share` phase also holds the gathering of the replies on rank 0
(which ends each iteration), and their `agree` phase the agreement on the step: every rank's token
count, gathered after the rank has scheduled its batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import PROMPTS  # noqa: E402  (the shipped benchmark prompts)

from minioverlap import LLM, SamplingParams  # noqa: E402


def run_case(tp: int, batch: int, overlap: bool, args: argparse.Namespace, dp: bool = False) -> dict:
    """One case: the median of --repeats runs after a warm-up -> its row."""
    llm = LLM(tp_size=tp, dp_attention=dp, overlap=overlap, max_running=16, chunked_prefill_size=-1, prefix_cache=False)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    runs = []
    try:
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            outs = llm.generate(PROMPTS[:batch], params)
            wall = time.perf_counter() - start
            assert all(len(o.token_ids) == args.tokens for o in outs)
            traces = llm.rank_traces()
            runs.append(dict(wall=wall, steps=len({e.step for e in traces[0]}),
                             phases=[t.phase_times_us() for t in traces]))
    finally:
        llm.shutdown()
    runs = runs[1:]
    row = dict(case=f"{'dp' if dp else 'tp'}{tp}-b{batch}-{'overlap' if overlap else 'normal'}", tp=tp, batch=batch,
               dp_attention=dp, loop="overlap" if overlap else "normal",
               tok_s=round(statistics.median(batch * args.tokens / r["wall"] for r in runs), 1),
               ms_step=round(statistics.median(r["wall"] / r["steps"] * 1e3 for r in runs), 3))
    for rank in range(tp):
        for phase in ("share", "agree", "launch"):
            values = [r["phases"][rank].get(phase) for r in runs]
            if None not in values:
                row[f"{phase}_us_rank{rank}"] = round(statistics.median(values), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case, after one warm-up (default 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--json", type=Path, help="write the results there (chapters/figures/20-cpu-ranks.json)")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    rows = []
    for batch in args.batches:
        for tp in (1, 2):
            torch.set_num_threads(max(1, threads // tp))
            rows += [run_case(tp, batch, overlap, args) for overlap in (False, True)]
        rows += [run_case(2, batch, overlap, args, dp=True) for overlap in (False, True)]
    torch.set_num_threads(threads)
    print(f"{'case':<18}{'tok/s':>9}{'ms/step':>9}{'share us r0':>13}{'share us r1':>13}{'agree us r0':>13}"
          f"{'launch us r0':>14}")
    nan = float("nan")
    for r in rows:
        print(f"{r['case']:<18}{r['tok_s']:>9.1f}{r['ms_step']:>9.2f}{r.get('share_us_rank0', nan):>13.1f}"
              f"{r.get('share_us_rank1', nan):>13.1f}{r.get('agree_us_rank0', nan):>13.1f}{r.get('launch_us_rank0', nan):>14.1f}")
    if args.json:
        created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z")
        args.json.write_text(json.dumps(dict(tool="tools/bench_ranks.py", created=created, argv=sys.argv[1:], device="cpu",
                                             model="tiny", tokens=args.tokens, repeats=args.repeats, threads=threads,
                                             results=rows), indent=1) + "\n")


if __name__ == "__main__":           # the ranks are spawned: each imports this file, and must not run it
    main()
