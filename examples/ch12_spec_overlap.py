"""Chapter 12: MTP speculative decoding in the overlap loop, next to the normal loop.

    python examples/ch12_spec_overlap.py

Two requests, greedy, three drafts a step, served by both loops. The overlap loop launches step N+1
before it handles step N, so a request that finishes inside step N's window is launched once more:
that step's window for it is wasted, and its tokens reach no client. The tokens are the same in both
loops, and the same as plain greedy decoding without MTP.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.device.hazard import HazardError
from minioverlap.device.trace import Trace

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
PARAMS, K = SamplingParams(max_tokens=24), 3


def served(trace: Trace) -> dict[int, list[int]]:
    """step -> the requests its reply went to."""
    return {e.step: list(e.uids) for e in trace if e.kind == "reply"}


def wasted(trace: Trace) -> list[tuple[int, int]]:
    """(step, request) for every request a step was launched with and replied nothing to."""
    replied = served(trace)
    return [(e.step, uid) for e in trace if e.kind == "launch" for uid in e.uids if uid not in replied[e.step]]


def events(trace: Trace) -> list[str]:
    """'launch N  uids' and 'handle N -> uids' lines; a request launched after its finish marked *."""
    lost, replied = set(wasted(trace)), served(trace)
    last = {uid: step for step, uids in replied.items() for uid in uids}      # the step that finished each
    lines = []
    for e in trace:
        if e.kind == "launch":
            uids = " ".join(f"[red]{u}*[/red]" if (e.step, u) in lost else str(u) for u in e.uids)
            lines.append(f"launch {e.step:<2}   {uids}")
        elif e.kind == "reply":
            done = [u for u in e.uids if last[u] == e.step]
            note = f"  ({', '.join(map(str, done))} finished)" if done else ""
            lines.append(f"handle {e.step:<2} -> {' '.join(map(str, e.uids)) or 'no reply'}{note}")
    return lines


def main() -> None:
    console = Console()
    engines = {"normal": LLM(overlap=False, mtp_steps=K), "overlap": LLM(overlap=True, mtp_steps=K)}
    windows: list[tuple[int, int, int, int]] = []     # (step, request, accepted, kept) in the overlap loop
    handle_window = engines["overlap"].scheduler.handle_window

    def recording(req, tokens, out):                   # listen in: what a step accepted, what the client got
        reply = handle_window(req, tokens, out)
        if reply is not None:                          # None: a window of a request that had finished
            windows.append((out.step, req.uid, len(tokens), len(reply.token_ids)))
        return reply

    engines["overlap"].scheduler.handle_window = recording
    outs = {loop: llm.generate(PROMPTS, PARAMS) for loop, llm in engines.items()}
    plain = LLM(overlap=False).generate(PROMPTS, PARAMS)

    console.rule(f"two requests, max_tokens={PARAMS.max_tokens}, greedy, k={K}: the events of both loops")
    table = Table("normal loop", "overlap loop", caption="*: launched after the step that finished it: a wasted window")
    lines = {loop: events(llm.trace) for loop, llm in engines.items()}
    for i in range(max(map(len, lines.values()))):
        table.add_row(*(rows[i] if i < len(rows) else "" for rows in lines.values()))
    console.print(table)

    console.rule("the overlap loop, request by request")
    table = Table("request", "tokens per reply", "tokens", "passes", "accept length",
                  caption="a of b: the window accepted b tokens, the client got a (max_tokens); passes: the prefill "
                          "and the verify steps")
    for out in outs["overlap"]:
        got = [f"{kept}" if kept == accepted else f"{kept} of {accepted}"
               for step, uid, accepted, kept in windows if uid == out.uid]
        table.add_row(str(out.uid), " ".join(got), str(len(out.token_ids)), str(out.verify_steps),
                      f"{len(out.token_ids) / out.verify_steps:.2f}")
    console.print(table)
    trace = engines["overlap"].trace
    finished = {uid: step for step, uids in served(trace).items() for uid in uids}
    for step, uid in wasted(trace):
        console.print(f"request {uid}: finished in step {finished[uid]}, launched again in step {step}, no reply",
                      highlight=False)

    checked = LLM(overlap=True, mtp_steps=K, hazard_check=True, max_running=1, page_size=4)
    try:                                               # one slot: request 1 takes request 0's row during its wasted window
        checked.generate(PROMPTS, PARAMS)
        waits = checked.runner.hazards.host_waits
        kind = "all" if all(w.startswith("the host waits for step") for w in waits) else "NOT all"
        report = f"silent (1 request slot; {len(waits)} host waits, {kind} copy-done)"
    except HazardError as error:
        report = f"HazardError: {error}"
    console.rule("key lines")
    tokens = {name: [o.token_ids for o in got] for name, got in [*outs.items(), ("plain", plain)]}
    same = tokens["overlap"] == tokens["normal"] == tokens["plain"]
    console.print(f"tokens: {'overlap == normal == plain greedy' if same else 'DIFFERENT'}", highlight=False)
    console.print("accept lengths: " + ", ".join(f"{len(o.token_ids) / o.verify_steps:.2f}" for o in outs["overlap"])
                  + " (tokens / passes)", highlight=False)
    console.print(f"steps: normal {sum(e.kind == 'launch' for e in engines['normal'].trace)}, "
                  f"overlap {sum(e.kind == 'launch' for e in trace)}", highlight=False)
    console.print(f"wasted windows: {len(wasted(trace))} (launched after the finish, no reply)", highlight=False)
    console.print(f"hazard checker: {report}", markup=False, highlight=False)


if __name__ == "__main__":
    main()
