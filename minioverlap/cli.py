"""The command line: `minioverlap generate PROMPT`."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from minioverlap.llm import LLM
from minioverlap.sampling_params import SamplingParams


def generate(args: argparse.Namespace, console: Console) -> None:
    llm = LLM(model=args.model, device=args.device)
    out = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens))[0]
    console.print(args.prompt, style="bold", end="", markup=False, highlight=False)
    console.print(out.text, markup=False, highlight=False)
    console.print(f"[dim]({len(out.token_ids)} tokens, finish_reason={out.finish_reason})[/dim]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minioverlap", description="A small LLM engine that teaches overlap scheduling.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tiny", help="'tiny' (shipped) or a local HF-format Qwen3 directory")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    console = Console()
    try:
        generate(args, console)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}", markup=True, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
