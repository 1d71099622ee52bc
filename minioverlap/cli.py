"""The command line: `minioverlap generate PROMPT` and, from chapter 04, `minioverlap trace`."""

from __future__ import annotations

import argparse
# >>> ch06: a file for Perfetto
import json
# <<< ch06
import sys
# >>> ch06: a file for Perfetto
import time
from pathlib import Path
# <<< ch06

from rich.console import Console
from rich.markup import escape
# >>> ch04: the event trace
from rich.table import Table
# <<< ch04
# >>> ch04: the text of each reply's tokens
from tokenizers.decoders import DecodeStream
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
    """Complete the prompt, printing the text as the tokens arrive."""
    llm = LLM(**engine_options(args))
    # >>> ch21: what the pool holds, on stderr (stdout is the completion)
    Console(stderr=True).print(llm.pool_summary(), style="dim", markup=False, highlight=False, soft_wrap=True)
    # <<< ch21
    params = SamplingParams(
        max_tokens=args.max_tokens,
        # >>> ch03: sampling
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        # <<< ch03
    )
    console.print(args.prompt, style="bold", end="", markup=False, highlight=False)
    # >>> ch04 replaces ch01: stream the tokens as the scheduler handles them
    #| out = llm.generate(args.prompt, params)[0]
    #| console.print(out.text, markup=False, highlight=False)
    #| tokens, reason = out.token_ids, out.finish_reason
    tokens: list[int] = []
    decoder = DecodeStream(skip_special_tokens=True)     # a token's text once its characters are complete
    for reply in llm.stream(args.prompt, params):
        text = "".join(decoder.step(llm.tokenizer, t) or "" for t in reply.token_ids)
        tokens, reason = tokens + reply.token_ids, reply.finish_reason
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    console.print()
    # <<< ch04
    console.print(f"[dim]({len(tokens)} tokens, finish_reason={reason})[/dim]")
    # >>> ch09: MTP: tokens per target pass
    if args.mtp:
        console.print(accept_length(llm, tokens), style="dim", highlight=False, soft_wrap=True)
    # <<< ch09
    # >>> ch19: the n-gram drafter's tokens per target pass
    if args.ngram:
        console.print(accept_length(llm, tokens), style="dim", highlight=False, soft_wrap=True)
    # <<< ch19


def engine_options(args: argparse.Namespace) -> dict:
    """The LLM options that the command line asks for."""
    options = {"model": args.model, "device": args.device}
    # >>> ch06: either loop (--loop), or the engine's default
    if args.loop is not None:
        options["overlap"] = args.loop == "overlap"
    # <<< ch06
    # >>> ch09: MTP drafts
    options |= mtp_options(args)
    # <<< ch09
    # >>> ch19: n-gram drafts
    if args.ngram:
        options["ngram_steps"] = args.ngram
    # <<< ch19
    # >>> ch18: the step's token budget, and mixed steps
    if args.chunked_prefill_size is not None:
        options["chunked_prefill_size"] = args.chunked_prefill_size
    if args.enable_mixed_chunk:
        options["mixed_chunk"] = True
    # <<< ch18
    # >>> ch20: ranks
    if args.tp != 1:
        options["tp_size"] = args.tp
    if args.dp_attention:
        options["dp_attention"] = True
    if args.dist_timeout is not None:
        options["dist_timeout"] = args.dist_timeout
    # <<< ch20
    # >>> ch21: the pool's size
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    if args.mem_fraction_static is not None:
        options["mem_fraction_static"] = args.mem_fraction_static
    if args.new_token_ratio is not None:
        options["new_token_ratio"] = args.new_token_ratio
    # <<< ch21
    return options
# >>> ch09: MTP


def mtp_options(args: argparse.Namespace) -> dict:
    """--mtp K: the MTP layer drafts K tokens a step (chapters 09-11: in the normal loop only)."""
    if not args.mtp:
        return {}
    # >>> ch12 replaces ch09: in either loop
    #| return {"mtp_steps": args.mtp, **normal_loop_only(args)}
    return {"mtp_steps": args.mtp}
    # <<< ch12
# >>> ch12 removes ch09: speculative decoding in the overlap loop is chapter 12's
#|
#|
#| def normal_loop_only(args: argparse.Namespace) -> dict:
#|     """The normal loop, or a clear error if the overlap loop was asked for."""
#|     if args.loop == "overlap":
#|         raise ValueError(f"--mtp {args.mtp} runs in the normal loop for now: drop --loop overlap "
#|                          "(speculative decoding in the overlap loop is chapter 12's)")
#|     return {"overlap": False}
# <<< ch12


def accept_length(llm: LLM, tokens: list[int]) -> str:
    """Tokens per target pass. One request: each step that replied to it is one target pass, the prefill
    too (a step launched after its finish, which the overlap loop may run, replies nothing)."""
    passes = sum(1 for e in llm.trace if e.kind == "reply" and e.uids)
    return (f"accept length {len(tokens) / passes:.2f} ({len(tokens)} tokens in {passes} passes: the prefill and "
            f"{passes - 1} verify steps)")
# <<< ch09
# >>> ch04: the event trace


def trace(args: argparse.Namespace, console: Console) -> None:
    """Run one request and print the loop's events, with host times."""
    # >>> ch06: a file for Perfetto: its folder first, so that a path that cannot be written fails before the runs
    if args.chrome:
        try:
            args.chrome.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--chrome {args.chrome}: cannot make its folder ({err})") from None
    # <<< ch06
    # >>> ch06 replaces ch04: either loop, or both side by side
    #| traces = {"normal": run_traced(args)}
    loops = ("normal", "overlap") if args.compare else (args.loop,)
    runs = {loop: run_traced(args, overlap=loop == "overlap") for loop in loops}    # loop -> (trace, start)
    traces = {loop: events for loop, (events, _) in runs.items()}
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
        args.chrome.write_text(json.dumps(chrome_trace(traces, {loop: start for loop, (_, start) in runs.items()})))
        console.print(f"wrote {args.chrome}: open it at https://ui.perfetto.dev")
    # <<< ch06


def event_table(loop: str, events: Trace) -> Table:
    table = Table("step", "event", "requests", "+ (us)", title=f"the {loop} loop")
    prev = events[0].t_ns
    for e in events:
        table.add_row(str(e.step), e.kind, ",".join(map(str, e.uids)), f"{(e.t_ns - prev) / 1e3:.0f}")
        prev = e.t_ns
    return table


# >>> ch06 replaces ch04: and when the run began, where the Perfetto file starts the first phase
#| def run_traced(args: argparse.Namespace, **engine_args) -> Trace:
#|     """Serve the prompt once in a fresh engine; its trace."""
#|     llm = LLM(model=args.model, device=args.device, **engine_args)
#|     llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
#|     return llm.trace
def run_traced(args: argparse.Namespace, **engine_args) -> tuple[Trace, int]:
    """Serve the prompt once in a fresh engine; its trace, and the host time (perf_counter_ns) the run began."""
    llm = LLM(**(engine_options(args) | engine_args))
    start = time.perf_counter_ns()
    llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    return llm.trace, start
# <<< ch06
# <<< ch04


# >>> ch16: the server


def serve(args: argparse.Namespace, console: Console) -> None:
    """Serve the model over OpenAI's HTTP API until Ctrl-C (SIGINT) or SIGTERM."""
    from minioverlap.server.launch import serve as run_server    # FastAPI and uvicorn load only for `serve`
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    options = engine_options(args)
    # >>> ch20: a choice rank 0's scheduler makes, which the other ranks' would not know of
    if args.first_tokens_first and args.tp > 1:
        raise ValueError(f"--first-tokens-first with --tp {args.tp}: every rank must make the same decisions, and "
                         "the other ranks do not run the server's option: drop one of them")
    # <<< ch20
    if args.first_tokens_first and args.loop == "normal":
        raise ValueError("--first-tokens-first changes the overlap loop; the normal loop handles every step before "
                         "the next launch already: drop one of --first-tokens-first and --loop normal")
    # >>> ch17 replaces ch16: and the prefix cache
    #| for name in ("cuda_graphs", "kernels", "max_running", "max_seq_len", "num_pages", "dtype"):
    #|     if getattr(args, name) is not None:
    #|         options[name] = getattr(args, name)
    for name in ("cuda_graphs", "kernels", "max_running", "max_seq_len", "num_pages", "dtype", "prefix_cache"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    # <<< ch17
    try:
        run_server(options, host=args.host, port=args.port, first_tokens_first=args.first_tokens_first,
                   max_body_bytes=args.max_body_bytes)
    except RuntimeError as err:          # the scheduler process could not build the engine: its error
        raise ValueError(str(err)) from None
# <<< ch16


def parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand per command, each option with its help."""
    top = argparse.ArgumentParser(prog="minioverlap", description="A small LLM engine that teaches overlap scheduling.")
    sub = top.add_subparsers(dest="command", required=True)
    commands = {"generate": (generate, "complete a prompt", 64)}
    # >>> ch04: the event trace
    commands["trace"] = (trace, "run a prompt and print the scheduler's events", 3)
    # <<< ch04
    # >>> ch16: the server
    commands["serve"] = (serve, "serve the model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions)", None)
    # <<< ch16
    for name, (run, help_text, max_tokens) in commands.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(run=run)
        if name == "generate":
            cmd.add_argument("prompt", help="the text to complete")
        elif max_tokens is not None:
            cmd.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="the prompt (default: %(default)r)")
        cmd.add_argument("--model", default="tiny", help="'tiny' (shipped) or a local HF-format Qwen3 directory")
        cmd.add_argument("--device", default="cpu", help="where the model runs: cpu (the default), cuda or cuda:N")
        if max_tokens is not None:
            cmd.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most (default: %(default)s)")
    # >>> ch03: sampling
    gen = sub.choices["generate"]
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (the default) is greedy; above 0 samples, the lower the sharper")
    gen.add_argument("--top-k", type=int, default=-1, help="sample only among the k most likely tokens (default -1: all)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample only among the fewest most likely tokens whose probability reaches p (default 1: all)")
    gen.add_argument("--seed", type=int, help="a seeded request draws the same tokens on every run")
    # <<< ch03
    # >>> ch06: both loops
    sub.choices["generate"].add_argument("--loop", choices=("normal", "overlap"),
                                         help="the scheduler loop that serves the request (default: the engine's)")
    trace_cmd = sub.choices["trace"]
    trace_cmd.add_argument("--loop", choices=("normal", "overlap"), default="normal",
                           help="the loop to trace (default: %(default)s)")
    trace_cmd.add_argument("--compare", action="store_true", help="run both loops and print them side by side")
    trace_cmd.add_argument("--chrome", type=Path, metavar="FILE",
                           help="also write Chrome trace-event JSON to FILE, for Perfetto (its folder is created)")
    # <<< ch06
    # >>> ch16: the server
    serve_cmd = sub.choices["serve"]
    serve_cmd.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    serve_cmd.add_argument("--loop", choices=("normal", "overlap"), help="the scheduler loop (default: the engine's)")
    serve_cmd.add_argument("--max-body-bytes", type=int, help="the largest request body; a larger one gets 413 "
                           "(default: 64 bytes per token of the context, at least 1 MiB)")
    serve_cmd.add_argument("--max-running", type=int, help="request slots: the most requests running at once "
                           "(default: the engine's); the others wait in the queue")
    serve_cmd.add_argument("--max-seq-len", type=int, help="the most tokens of one request, prompt included "
                           "(default: the model's context); the KV pool has room for every slot's")
    # >>> ch21 replaces ch16: the default is chapter 21's
    #| serve_cmd.add_argument("--num-pages", type=int, help="pages in the KV pool, page 0 included (default: room for "
    #|                        "every slot's full context)")
    serve_cmd.add_argument("--num-pages", type=int, help="pages in the KV pool, page 0 included (default: from "
                           "--max-total-tokens or --mem-fraction-static)")
    # <<< ch21
    serve_cmd.add_argument("--dtype", help="float32, bfloat16 or float16 (default: float32 on a CPU, the checkpoint's on a GPU)")
    serve_cmd.add_argument("--first-tokens-first", action="store_true",
                           help="the overlap loop handles a prefill before the next launch: the first token "
                                "sooner, the device idle once per prefill (chapter 16)")
    serve_cmd.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                           help="decode steps as CUDA graph replays (default: on for CUDA)")
    serve_cmd.add_argument("--kernels", action=argparse.BooleanOptionalAction,
                           help="the fast path: fused kernels and Triton attention (default: on for CUDA, chapter 15)")
    # <<< ch16
    # >>> ch17: the prefix cache
    serve_cmd.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction,
                           help="keep computed prefixes in a radix tree and reuse them (default: on; chapter 17)")
    # <<< ch17
    # >>> ch09: MTP drafts
    for cmd in sub.choices.values():
        cmd.add_argument("--mtp", type=int, default=0, metavar="K",
                         help="drafts per step with the model's MTP layer (speculative decoding)")
    # <<< ch09
    # >>> ch20: ranks
    for cmd in sub.choices.values():
        cmd.add_argument("--tp", type=int, default=1, metavar="N",
                         help="tensor parallelism over N ranks, one process and one device each (chapter 20)")
        cmd.add_argument("--dp-attention", action="store_true",
                         help="with --tp N: each rank serves its own requests, attention alone, the MLP over all (chapter 20)")
        cmd.add_argument("--dist-timeout", type=float, default=None, metavar="S",
                         help="seconds a collective waits for a stuck rank (default 60; an idle wait has none)")
    # <<< ch20
    # >>> ch19: n-gram drafts
    for cmd in sub.choices.values():
        cmd.add_argument("--ngram", type=int, default=0, metavar="K",
                         help="drafts per step looked up in the request's own tokens (prompt lookup decoding, chapter 19)")
    # <<< ch19
    # >>> ch18: the step's token budget, and mixed steps
    for cmd in sub.choices.values():
        cmd.add_argument("--chunked-prefill-size", type=int, metavar="N",
                         help="prompt tokens a step may run; a longer prompt is prefilled in chunks (default: 8192 "
                              "on a GPU, 64 on a CPU; -1: every prompt whole; chapter 18)")
        cmd.add_argument("--enable-mixed-chunk", action="store_true",
                         help="a prefill step carries the running requests' decode rows too (chapter 18)")
    # <<< ch18
    # >>> ch21: the pool's size
    for cmd in sub.choices.values():
        cmd.add_argument("--max-total-tokens", type=int, metavar="N",
                         help="tokens the KV pool holds (default: what --mem-fraction-static leaves on a GPU, every "
                              "slot's full context on a CPU; chapter 21)")
        cmd.add_argument("--mem-fraction-static", type=float, metavar="F",
                         help="share of the device's memory for the weights and the KV pool (default: 0.88 on a GPU; "
                              "on a CPU of its physical memory; chapter 21)")
        cmd.add_argument("--new-token-ratio", type=float, metavar="R",
                         help="admit a request by what it needs now and R of the tokens it may still make (SGLang: "
                              "0.7), and take requests back when a step runs out of pages (default: admit only "
                              "what the pool holds whole; chapter 21)")
    # <<< ch21
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    console = Console()
    try:
        args.run(args, console)
    except (ValueError, OSError) as err:      # a bad argument, a checkpoint the loader refuses (it names the file), a path
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(err))}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
