"""Chapter 21: two requests admitted by need into a pool too small for both to finish. At 12 tokens each
they hold 3 pages of 4 tokens; the next step needs a fourth for each, and only the 6 pages of the pool
are there: request 1 (as few tokens as request 0, the longer prompt) is taken back. The example prints
each loop's events around the retraction, then when request 1 comes back, and checks that both
requests get the tokens they get alone.

    python examples/ch21_memory.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10, 11]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def show(title: str, llm: LLM) -> None:
    events = [(e.kind, e.step, list(e.uids)) for e in llm.trace if e.kind != "wait"]
    at = next(i for i, (kind, _, _) in enumerate(events) if kind == "retract")
    back = next(i for i, (kind, step, uids) in enumerate(events) if kind == "schedule" and i > at and 1 in uids)
    print(title)
    for kind, step, uids in events[at - 2:at + 5] + [("...", "", "")] + events[back - 2:back + 2]:
        print(f"  {kind:<8} {step:>4}  {uids}")


alone = [LLM(page_size=4).generate([p], PARAMS)[0].token_ids for p in PROMPTS]
for title, overlap in [("normal loop", False), ("overlap loop", True)]:
    llm = LLM(page_size=4, max_running=2, num_pages=7, new_token_ratio=0.1, prefix_cache=False, overlap=overlap)
    outs = llm.generate(PROMPTS, PARAMS)
    show(title, llm)
    llm.check_integrity()
    print(f"  taken back: {llm.scheduler.retraction.count}; tokens equal to each request alone: "
          f"{[o.token_ids for o in outs] == alone}\n")
