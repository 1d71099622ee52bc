"""The command line: `minioverlap generate PROMPT` and, from chapter 04, `minioverlap trace`."""

from __future__ import annotations

import argparse
# >>> ch06: a file for Perfetto
import json
# <<< ch06
import sys
# >>> ch06: a file for Perfetto
from pathlib import Path
# <<< ch06

from rich.console import Console
# >>> ch04: the event trace
from rich.table import Table
# <<< ch04
# >>> ch06: side by side
from rich.columns import Columns
# <<< ch06

from minioverlap.llm import LLM
from minioverlap.sampling_params import SamplingParams
# >>> ch04: the event trace
from minioverlap.device.trace import Trace
# <<< ch04
# >>> ch06: a file for Perfetto
from minioverlap.device.trace import chrome_trace
# <<< ch06


def generate(args: argparse.Namespace, console: Console) -> None:
    llm = LLM(model=args.model, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens)
    console.print(args.prompt, style="bold", end="", markup=False, highlight=False)
    # >>> ch04 replaces ch01: stream the tokens as the scheduler handles them
    #| out = llm.generate(args.prompt, params)[0]
    #| console.print(out.text, markup=False, highlight=False)
    #| tokens, reason = out.token_ids, out.finish_reason
    tokens: list[int] = []
    for reply in llm.stream(args.prompt, params):
        text = llm.decode(tokens + reply.token_ids)[len(llm.decode(tokens)):]
        tokens, reason = tokens + reply.token_ids, reply.finish_reason
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    console.print()
    # <<< ch04
    console.print(f"[dim]({len(tokens)} tokens, finish_reason={reason})[/dim]")
# >>> ch04: the event trace


def trace(args: argparse.Namespace, console: Console) -> None:
    """Run one request and print the loop's events, with host times."""
    # >>> ch06 replaces ch04: either loop, or both side by side
    #| traces = {"normal": run_traced(args)}
    loops = ("normal", "overlap") if args.compare else (args.loop,)
    traces = {loop: run_traced(args, overlap=loop == "overlap") for loop in loops}
    # <<< ch06
    tables = [event_table(loop, events) for loop, events in traces.items()]
    # >>> ch06 replaces ch04: side by side
    #| console.print(tables[0])
    console.print(Columns(tables))
    # <<< ch06
    for loop, events in traces.items():
        console.print(f"{loop + ':':9}" + ", ".join(events.order()), markup=False, highlight=False)
    # >>> ch06: GPU timestamps
    for loop, events in traces.items():
        if gaps := sorted(events.gpu_gaps_ms()):
            console.print(f"{loop + ':':9}median GPU gap between steps {gaps[len(gaps) // 2]:.3f} ms "
                          f"(max {gaps[-1]:.3f} ms, {len(gaps)} gaps)")
    # <<< ch06
    # >>> ch06: a file for Perfetto
    if args.chrome:
        args.chrome.write_text(json.dumps(chrome_trace(traces)))
        console.print(f"wrote {args.chrome}: open it at https://ui.perfetto.dev")
    # <<< ch06


def event_table(loop: str, events: Trace) -> Table:
    table = Table("step", "event", "requests", "+ (us)", title=f"the {loop} loop")
    prev = events[0].t_ns
    for e in events:
        table.add_row(str(e.step), e.kind, ",".join(map(str, e.uids)), f"{(e.t_ns - prev) / 1e3:.0f}")
        prev = e.t_ns
    return table


def run_traced(args: argparse.Namespace, **engine_args) -> Trace:
    llm = LLM(model=args.model, device=args.device, **engine_args)
    llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    return llm.trace
# <<< ch04


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minioverlap", description="A small LLM engine that teaches overlap scheduling.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"generate": (generate, "complete a prompt", 64)}
    # >>> ch04: the event trace
    commands["trace"] = (trace, "run a prompt and print the scheduler's events", 3)
    # <<< ch04
    for name, (_, help_text, max_tokens) in commands.items():
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("prompt", nargs="?" if name != "generate" else None, default="def fibonacci(n):")
        cmd.add_argument("--model", default="tiny", help="'tiny' (shipped) or a local HF-format Qwen3 directory")
        cmd.add_argument("--device", default="cpu")
        cmd.add_argument("--max-tokens", type=int, default=max_tokens)
    # >>> ch06: both loops
    trace_cmd = sub.choices["trace"]
    trace_cmd.add_argument("--loop", choices=("normal", "overlap"), default="normal")
    trace_cmd.add_argument("--compare", action="store_true", help="run both loops and print them side by side")
    trace_cmd.add_argument("--chrome", type=Path, help="write Chrome trace-event JSON (Perfetto opens it)")
    # <<< ch06
    args = parser.parse_args(argv)
    console = Console()
    try:
        commands[args.command][0](args, console)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}", markup=True, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
