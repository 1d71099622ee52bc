"""What CUDA graphs (chapter 13) and the overlap loop buy on a GPU, side by side in one run (needs CUDA).

    python tools/bench_graphs.py                        # batch 1 and 16, 128 new tokens, median of 3
    python tools/bench_graphs.py --batches 1 4 16 --tokens 64 --repeats 5
    python tools/bench_graphs.py --mtp 3                # the same four engines with MTP, k = 3, beside them

Four engines of the tiny model in fp32 serve the same code prompts, each generating exactly --tokens new
tokens (greedy, ignore_eos): the normal and the overlap loop, each with the decode step launched kernel
by kernel (cuda_graphs=False) and as one graph replay (cuda_graphs=True). They are warmed up once and
take turns for --repeats timed runs. Per engine: tokens/s, its ratio to the normal loop without graphs,
milliseconds per step, and the median GPU gap between consecutive steps (chapter 06's timestamps: the
time the GPU waited for the host). With --mtp K, four more engines draft K tokens a step (chapter 09),
with the verify step eager or as three graph replays (chapter 13); every ratio is to the first engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minioverlap import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
           "def is_prime(n):\n    ", "    def __repr__(self):", "for i in range(10):", "def quicksort(items):",
           "class Node:\n    def __init__(self, value):"]


def race(engines: dict[tuple[int, bool, bool], LLM], prompts: list[str], params: SamplingParams,
         repeats: int) -> tuple[dict, dict]:
    """Wall seconds and median GPU gaps (ms) of each engine, the engines taking turns; round 0 warms up."""
    times, gaps = {key: [] for key in engines}, {key: [] for key in engines}
    for rnd in range(repeats + 1):
        for key, llm in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            if rnd:
                times[key].append(time.perf_counter() - start)
                gaps[key].append(statistics.median(llm.trace.gpu_gaps_ms()))
    return times, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="concurrent requests (default 1 16)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, taking turns")
    parser.add_argument("--mtp", type=int, default=0, metavar="K", help="also race engines drafting K tokens a step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphs.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, tiny model, fp32, {args.tokens} new tokens, "
          f"median of {args.repeats}")
    for batch in args.batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        engines = {(k, overlap, graphs): LLM(device="cuda", dtype="float32", overlap=overlap, cuda_graphs=graphs,
                                             max_running=max(batch, 1), mtp_steps=k,
                                             prefix_cache=False)     # the runs repeat their prompts: each recomputes them, as recorded
                   for k in sorted({0, args.mtp}) for graphs in (False, True) for overlap in (False, True)}
        times, gaps = race(engines, prompts, params, args.repeats)
        base = statistics.median(times[(0, False, False)])
        for (k, overlap, graphs), seconds in times.items():
            m = statistics.median(seconds)
            print(f"batch {batch:3d} {f'MTP {k}' if k else 'plain':6s} {'overlap' if overlap else 'normal':7s} "
                  f"graphs {'on ' if graphs else 'off'}: {batch * args.tokens / m:8.0f} tok/s ({base / m:5.2f}x)  "
                  f"{m / args.tokens * 1e3:6.2f} ms/token  median GPU gap {statistics.median(gaps[(k, overlap, graphs)]):.3f} ms")


if __name__ == "__main__":
    main()
