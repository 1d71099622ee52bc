"""Chapter 09: MTP speculative decoding in the normal loop, step by step: the drafts, the accepted
prefix, the bonus token and the accept length; then the accept length of five code prompts.

    python examples/ch09_mtp.py

Each step runs the target once over a window of k+1 tokens: the bonus token of the previous step and
the MTP layer's k drafts. The target keeps the drafts it agrees with and adds one token of its own (the
new bonus), so a step yields 1..k+1 tokens, and greedy MTP yields exactly plain greedy's tokens.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import minioverlap.speculative.runner as speculative
from minioverlap import LLM, SamplingParams

PROMPT, TOKENS, K = "def fibonacci(n):", 48, 3
# tools/make_model.py's SAMPLE_PROMPTS: the prompts of the tiny model's card
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
                  "def is_prime(n):\n    ", "    def __repr__(self):"]

# The example listens in on the accept step: speculative.verify calls `accept(logits, drafts, reqs)`
# through its module's global name, so putting a recording wrapper there shows every step's drafts and
# window without changing the engine. The wrapper returns exactly what accept returns.
calls: list[tuple[list[list[int]], list[list[int]], list[int]]] = []   # (drafts, tokens, accept_lens) per verify
accept = speculative.accept


def recording_accept(logits: torch.Tensor, drafts: torch.Tensor, reqs) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, accept_lens = accept(logits, drafts, reqs)
    calls.append((drafts.tolist(), tokens.tolist(), accept_lens.tolist()))
    return tokens, accept_lens


def show(llm: LLM, ids: list[int]) -> str:
    return " ".join(repr(llm.decode([t])) for t in ids)


def step_table(llm: LLM, replies: list[list[int]], steps: list[tuple | None]) -> Table:
    """One row per step: the prefill (no drafts), then each verify step with its drafts."""
    table = Table("step", "drafts", "as text", "acc", "bonus", "length",
                  title=f"{PROMPT!r}, greedy, k={K}: one target pass per step",
                  caption="drafts: green accepted, red rejected; acc: how many; bonus: the target's own")
    for column in table.columns[1:5]:
        column.no_wrap = True
    for n, (got, call) in enumerate(zip(replies, steps), start=1):
        if call is None:                               # the prefill: the target's first token, no drafts yet
            table.add_row(str(n), "-", "prefill", "-", f"{got[0]} {llm.decode([got[0]])!r}", str(len(got)))
            continue
        drafts, window, accept_len = call
        a = accept_len - 1                             # drafts accepted; window[a] is the target's own token
        marks = " ".join(f"[green]{d}[/green]" if i < a else f"[red]{d}[/red]" for i, d in enumerate(drafts))
        cut = "" if len(got) == accept_len else f" ({len(got)})"     # the last window, cut by max_tokens
        table.add_row(str(n), marks, show(llm, drafts), str(a), f"{window[a]} {llm.decode([window[a]])!r}",
                      f"{accept_len}{cut}")
    return table


def main() -> None:
    console = Console()
    speculative.accept = recording_accept              # listen in on the accept step (see above)
    llm = LLM(model="tiny", overlap=False, mtp_steps=K)
    plain = LLM(model="tiny", overlap=False)
    params = SamplingParams(max_tokens=TOKENS)

    replies, steps, seen = [], [], 0
    for reply in llm.stream(PROMPT, params):           # the normal loop: each reply is one handled step
        replies.append(reply.token_ids)
        if len(calls) == seen:                         # no accept since the last reply: the prefill
            steps.append(None)
        else:                                          # a verify step: its call, row 0 (the one request)
            (drafts, *_), (window, *_), (accept_len, *_) = calls[-1]
            steps.append((drafts, window, accept_len))
        seen = len(calls)
    console.print(step_table(llm, replies, steps))
    if len(replies[-1]) < steps[-1][2]:
        console.print(f"(the last window: max_tokens={TOKENS} keeps {len(replies[-1])} of its {steps[-1][2]} tokens)",
                      highlight=False)
    tokens = [t for got in replies for t in got]
    same = tokens == plain.generate(PROMPT, params)[0].token_ids
    steps_run = len(replies)                           # one request: one reply per step, the prefill's too
    console.print(f"accept length {len(tokens) / steps_run:.2f} ({len(tokens)} tokens in {steps_run} passes: the "
                  f"prefill and {steps_run - 1} verify steps)",
                  highlight=False)
    console.print(f"same tokens as plain greedy: {same}", highlight=False)
    console.print(PROMPT + llm.decode(tokens), markup=False, highlight=False)

    params = SamplingParams(max_tokens=64)
    outs, plains = llm.generate(SAMPLE_PROMPTS, params), plain.generate(SAMPLE_PROMPTS, params)
    table = Table("prompt", "tokens", "passes", "accept", "same", title=f"the tiny model's card prompts, greedy, "
                  f"k={K}, one batch", caption="passes: prefill + verifies; accept: tokens / passes; same: as plain "
                  "greedy")
    table.columns[0].no_wrap = True
    for prompt, out, ref in zip(SAMPLE_PROMPTS, outs, plains):
        table.add_row(repr(prompt), str(len(out.token_ids)), str(out.verify_steps),
                      f"{len(out.token_ids) / out.verify_steps:.2f}", str(out.token_ids == ref.token_ids))
    console.print(table)
    total, verifies = sum(len(o.token_ids) for o in outs), sum(o.verify_steps for o in outs)
    same = sum(out.token_ids == ref.token_ids for out, ref in zip(outs, plains))
    console.print(f"same tokens as plain greedy on {same} of {len(outs)} prompts", highlight=False)
    console.print(f"all prompts: accept length {total / verifies:.2f} ({total} tokens in {verifies} passes, "
                  f"{len(outs)} of them prefills)",
                  highlight=False)


if __name__ == "__main__":
    main()
