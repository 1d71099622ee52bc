"""Chapter 21's measurement: the same memory, two ways to use it. A pool of `--contexts` whole requests is
either reserved for the worst case (max_running = contexts: every request slot holds a whole context, and
admission takes a request only when every page it may need is free) or shared by more request slots
(--slots) with admission by need (new_token_ratio, each of --ratios) and retraction. Both loops, side by side, --repeats times
in turn; the report gives each run's requests per step (mean and most), tokens per second, steps and
retractions, and the median of the repeats.

    python tools/bench_memory.py                                # the tiny model on this machine's CPU
    python tools/bench_memory.py --requests 16 --repeats 1 --ratios 0.7 --out /tmp/m.json

The workload is drawn once from random.Random(--seed): --requests prompts of 8 to 48 token ids, each asking
for at most --max-tokens, sampled (temperature 1, a seed each) and stopped by token 63, which the tiny model
samples often enough that most requests stop well before max_tokens, as real ones do; every run gets the
same tokens (a seeded request keeps its draws when it is taken back).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minioverlap import LLM, SamplingParams  # noqa: E402

STOP = 63                      # a token the tiny model samples often: the requests end at different lengths
PROMPT_LENS = (8, 48)


def workload(n: int, max_tokens: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(*PROMPT_LENS))] for _ in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, stop_token_ids=[STOP]) for i in range(n)]
    return prompts, params


def configs(contexts: int, slots: int, max_seq_len: int, page_size: int, ratios: list[float]) -> dict[str, dict]:
    """The uses of the same pool: reserved for `contexts` whole requests, or shared by need, with each of
    the first estimates in `ratios` (SGLang's is 0.7)."""
    pages = contexts * -(-max_seq_len // page_size) + 1
    return {"worst-case": dict(max_running=contexts),
            **{f"by-need-{r}": dict(max_running=slots, num_pages=pages, new_token_ratio=r) for r in ratios}}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.check_integrity()
    sizes = [len(e.uids) for e in llm.trace if e.kind == "schedule"]
    retraction = llm.scheduler.retraction
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds, "steps": len(sizes),
            "mean_reqs": statistics.mean(sizes), "max_reqs": max(sizes),
            "retractions": retraction.count if retraction else 0, "tokens": [o.token_ids for o in outs]}


def measure(args: argparse.Namespace) -> dict:
    max_seq_len = PROMPT_LENS[1] + args.max_tokens
    prompts, params = workload(args.requests, args.max_tokens, args.seed)
    engines = {(loop, name): LLM(overlap=loop == "overlap", max_seq_len=max_seq_len, page_size=args.page_size,
                                 prefix_cache=False, **options)
               for loop in ("normal", "overlap")
               for name, options in configs(args.contexts, args.slots, max_seq_len, args.page_size, args.ratios).items()}
    runs = {key: [] for key in engines}
    for _ in range(args.repeats):
        for key, llm in engines.items():
            runs[key].append(run(llm, prompts, params))
    tokens = {key: rs[0].pop("tokens") for key, rs in runs.items()}
    for rs in runs.values():
        for r in rs[1:]:
            r.pop("tokens")
    same = all(t == tokens[("normal", "worst-case")] for t in tokens.values())
    results = [{"loop": loop, "pool": name, "slots": engines[(loop, name)].max_running,
                "tok_s": statistics.median(r["tok_s"] for r in rs),
                **{k: rs[0][k] for k in ("steps", "mean_reqs", "max_reqs", "retractions")}, "runs": rs}
               for (loop, name), rs in runs.items()]
    pool_tokens = (args.contexts * -(-max_seq_len // args.page_size)) * args.page_size
    return {"config": {**vars(args), "max_seq_len": max_seq_len, "pool_tokens": pool_tokens, "stop_token": STOP},
            "same_tokens": same, "results": results}


def report(data: dict) -> str:
    c = data["config"]
    lines = [f"{c['requests']} requests, a pool of {c['pool_tokens']} tokens ({c['contexts']} whole contexts of "
             f"{c['max_seq_len']}); tokens the same in every run: {data['same_tokens']}",
             f"{'loop':<8} {'pool':<14} {'slots':>5} {'reqs/step':>9} {'most':>5} {'steps':>6} {'retracted':>9} {'tok/s':>8}"]
    for r in data["results"]:
        lines.append(f"{r['loop']:<8} {r['pool']:<14} {r['slots']:>5} {r['mean_reqs']:>9.1f} {r['max_reqs']:>5} "
                     f"{r['steps']:>6} {r['retractions']:>9} {r['tok_s']:>8.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--contexts", type=int, default=8, help="whole contexts the pool holds")
    parser.add_argument("--slots", type=int, default=32, help="request slots sharing the pool by need")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.7, 0.3], help="first estimates (new_token_ratio)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    data = measure(args)
    print(report(data))
    if args.out:
        data["config"].pop("out")
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
