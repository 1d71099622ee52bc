"""Chapter 20: the tiny model over two CPU ranks (gloo), tensor-parallel. Each rank is a process with its own
scheduler and half of every layer; before each iteration every rank takes rank 0's inbox (`share`), and
from then on all make the same decisions. The example prints the tokens (equal to one device's) and both
ranks' first events, in each loop: the same steps on both ranks, each iteration opened by the share; in
the overlap loop the share of iteration N+1 happens while step N, launched before it, runs.

Then DP attention, in the overlap loop: each rank serves its own requests, and before each step the ranks
agree on it (`agree`, with every rank's token count); with one request, rank 1 runs the empty batch
(`idle`) in every step rank 0 runs.

    python examples/ch20_parallel.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:"]
PARAMS = SamplingParams(max_tokens=12)


def main() -> None:
    one = [o.token_ids for o in LLM(overlap=False).generate(PROMPTS, PARAMS)]
    for overlap in (False, True):
        llm = LLM(tp_size=2, overlap=overlap)          # rank 0 here; rank 1 in a process it starts
        try:
            outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
            print(f"{'overlap' if overlap else 'normal'} loop, 2 ranks: the tokens of one device: {outs == one}")
            for rank, trace in enumerate(llm.rank_traces()):
                events = ", ".join(f"{e.kind} {e.step}" for e in trace[:11])
                print(f"  rank {rank}: {events}, ...")
        finally:
            llm.shutdown()
    print("no rank left:", llm.ranks is None)
    dp_attention(one)


def dp_attention(one: list[list[int]]) -> None:
    llm = LLM(tp_size=2, dp_attention=True, overlap=True)
    try:
        outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        print(f"DP attention, overlap loop, 2 ranks: the tokens of one device: {outs == one}")
        show(llm.rank_traces())
        llm.generate(PROMPTS[:1], PARAMS)
        print("one request:")
        show(llm.rank_traces())
    finally:
        llm.shutdown()


def show(traces: list) -> None:
    """Each rank's first events; an agreement with every rank's token count."""
    for rank, trace in enumerate(traces):
        events = ", ".join(f"{e.kind} {e.step}" + (f" {list(e.uids)}" if e.kind == "agree" else "") for e in trace[:9])
        print(f"  rank {rank}: {events}, ...")


if __name__ == "__main__":           # the ranks are spawned: each imports this file, and must not run it
    main()
