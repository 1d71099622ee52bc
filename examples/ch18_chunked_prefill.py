"""Chapter 18: a long prompt arrives while two requests stream. Whole, it is one long prefill step and the
streams wait for it; in chunks of 16 tokens it is several prefill steps and they still wait; mixed, each
chunk step carries the streams' decode rows too, and no stream misses a step. The example prints each
run's steps: the requests a step ran (* a chunk of a prompt), and which requests got a token from it.

    python examples/ch18_chunked_prefill.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams

STREAMS = ["def fibonacci(n):", "class Stack:"]
LONG = "import os\n" + "x = [1, 2, 3]\nprint(x)\n" * 6


def run(llm: LLM) -> list[list[int]]:
    """Stream the two short requests; at the first one's first token, the long prompt arrives."""
    tokens: dict[int, list[int]] = {}
    for reply in llm.stream(STREAMS, SamplingParams(max_tokens=12, ignore_eos=True)):
        tokens.setdefault(reply.uid, []).extend(reply.token_ids)
        if reply.uid == 0 and len(tokens[0]) == 1 and 2 not in tokens:
            tokens[llm.add_request(LONG, SamplingParams(max_tokens=4, ignore_eos=True))] = []
    llm.check_integrity()
    return [tokens[uid] for uid in sorted(tokens)]


def show(title: str, llm: LLM, steps: int = 9) -> None:
    events = {kind: {e.step: e.uids for e in llm.trace if e.kind == kind} for kind in ("schedule", "chunk", "reply")}
    print(title)
    for n, uids in list(events["schedule"].items())[:steps]:
        ran = " ".join(f"{u}*" if u in events["chunk"].get(n, ()) else f"{u}" for u in uids)
        print(f"  step {n:2}  ran {ran:<10}  tokens to {list(events['reply'].get(n, ()))}")


print(f"the long prompt: {len(LLM().encode(LONG))} tokens; each run's first steps:\n")
want = None
for title, options in [("whole prompts (chunked_prefill_size=-1)", dict(chunked_prefill_size=-1)),
                       ("chunks of 16", dict(chunked_prefill_size=16)),
                       ("chunks of 16, mixed", dict(chunked_prefill_size=16, mixed_chunk=True))]:
    llm = LLM(overlap=False, **options)
    got = run(llm)
    want = want or got
    show(title, llm)
    print(f"  tokens equal to whole prompts': {got == want}\n")
