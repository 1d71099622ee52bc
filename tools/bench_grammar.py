"""A request with a new JSON schema arrives while a stream runs (chapter 19): how long does the stream wait?

    python tools/bench_grammar.py                     # the tiny model on the CPU, both loops
    python tools/bench_grammar.py --fields 12 --tokens 160 --arrive 40 --repeats 5

One stream of --tokens tokens (ignore_eos) runs alone; after its --arrive-th token a request arrives
(LLM.add_request) whose JSON schema has --fields required properties of mixed types, a schema never seen
before (its property names are new each run). The measures are the stream's gaps, the wall time
between two of its consecutive replies: the arrival's (the gap the request is added in), the longest,
which may also be the new request's prefill step (a step the stream is not in, whichever way), and the
median, a plain step. Two ways:

    sync        the grammar compiled where the request is made, on the scheduler's thread, as before
                the grammar queue: what the stream waits for is the compile (the old path)
    background  the grammar compiled in the backend's thread (GrammarBackend); the request waits in the
                scheduler's grammar queue, and the stream's steps go on meanwhile

and two moments: `first`, the engine's first grammar, whose compile also builds xgrammar's view of the
vocabulary (its TokenizerInfo), and `new`, a new schema once an earlier one has been compiled. The
module that imports xgrammar is imported before the runs: a process pays for that once, in both ways.
Each row gives the median over --repeats runs of each gap, a fresh engine per run; the last column is
the sync row's arrival gap over this row's. Nothing here is asserted: the tests prove
the order of events (tests/test_ch19_grammar_queue.py), this measures the time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from minioverlap import LLM, SamplingParams
from minioverlap.constrained import grammar  # noqa: F401  (xgrammar imported before any run)

PROMPT = "def fibonacci(n):"
TYPES = ["string", "integer", "boolean", "number"]
names = itertools.count()


def schema(fields: int) -> dict:
    """A JSON schema of `fields` required properties, named anew at every call: never compiled before."""
    run = next(names)
    props = {f"field_{run}_{i}": {"type": TYPES[i % len(TYPES)]} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def compile_at_once(llm: LLM) -> None:
    """The old path: the request's grammar is compiled where the request is made (Processor.grammar
    returns once its compile is done), on the thread that runs the scheduler's loop."""
    make = llm.processor.grammar

    def grammar(params: SamplingParams):
        made = make(params)
        if made is not None:
            made.compiled.result()
        return made
    llm.processor.grammar = grammar


def gaps_ms(llm: LLM, args: argparse.Namespace) -> list[float]:
    """One run: the stream's gaps between consecutive replies, ms; the schema's request added at --arrive."""
    stream = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=8, json_schema=schema(args.fields))
    times, uid = [], llm.next_uid
    for reply in llm.stream(PROMPT, stream):
        if reply.uid == uid:
            times.append(time.perf_counter())
            if len(times) == args.arrive:
                llm.add_request(PROMPT, constrained)
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def run(loop: str, moment: str, way: str, args: argparse.Namespace) -> dict:
    """The median over --repeats runs of the stream's arrival, longest and median gap; a fresh engine per run."""
    arrival, longest, median = [], [], []
    for _ in range(args.repeats):
        llm = LLM(overlap=loop == "overlap")
        if moment == "new":                                # the vocabulary built, an earlier schema compiled
            llm.generate(PROMPT, SamplingParams(max_tokens=4, json_schema=schema(args.fields)))
        if way == "sync":
            compile_at_once(llm)
        gaps = gaps_ms(llm, args)
        arrival.append(gaps[args.arrive - 1])              # from the --arrive-th reply, after which it is added
        longest.append(max(gaps))
        median.append(statistics.median(gaps))
    return dict(loop=loop, moment=moment, way=way, arrival_ms=round(statistics.median(arrival), 2),
                longest_ms=round(statistics.median(longest), 2),
                median_ms=round(statistics.median(median), 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fields", type=int, default=12, help="the new schema's properties (default 12)")
    ap.add_argument("--tokens", type=int, default=120, help="the stream's tokens (default 120)")
    ap.add_argument("--arrive", type=int, default=30, help="the stream's token after which the request arrives (default 30)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row; the median is shown (default 3)")
    ap.add_argument("--loops", nargs="+", default=["normal", "overlap"], choices=("normal", "overlap"))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = [run(loop, moment, way, args) for loop in args.loops for moment in ("first", "new")
            for way in ("sync", "background")]
    print(f"{'loop':<9}{'grammar':<8}{'compile':<12}{'arrival gap ms':>15}{'longest ms':>12}{'median ms':>11}"
          f"{'sync / this':>13}")
    for r in rows:
        sync = next(s for s in rows if (s["loop"], s["moment"], s["way"]) == (r["loop"], r["moment"], "sync"))
        print(f"{r['loop']:<9}{r['moment']:<8}{r['way']:<12}{r['arrival_ms']:>15.2f}{r['longest_ms']:>12.2f}"
              f"{r['median_ms']:>11.2f}{sync['arrival_ms'] / r['arrival_ms']:>12.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tool="tools/bench_grammar.py", fields=args.fields, tokens=args.tokens, arrive=args.arrive,
                           repeats=args.repeats, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
