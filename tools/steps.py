"""The step checker: one annotated source, a working tree for every chapter.

minioverlap/ holds the final engine. Markers in the source (`# >>> ch06: ...` / `# <<< ch06`) say
when each block arrives; this tool derives the tree as of any chapter (a *stage*) and proves that
every stage works: its tests pass, its example runs, every regression test catches the bug it was
written for, the tests catch every bug planted in the registry, every snippet in the chapters
equals its stage's source, every transcript is what its command prints, and every figure the prose
quotes from a recorded run (chapters/figures/*.json) or a transcript is the number there. It also
holds the source to rules that keep it readable as chapters pile up. tools/README.md holds the
grammar; this file is the command line, and tools/book/ the splitter and the checker, a module per
concern (tools/README.md: "Where the code is").

    python tools/steps.py build N                  # build/stages/chNN/
    python tools/steps.py check [--chapters 1-3] [--no-proofs]
    python tools/steps.py diff N [--code] | tree N | bugs N | snippets [--write] | outputs [--chapters 9-14]

The judge's modules, practice/judging/, import it (`sys.path.insert(0, "tools"); import steps`)
for load_registry, build_stage, stage_text, find_exercises and run_pytest, and load_book, blocks and
render to read an exercise's reference region; tests/tools/test_steps.py for these and a few more.
They are re-exported here from tools/book/, where they live.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# tools/book/ is a package beside this file (tools/ is on the path when this file runs as a script,
# and importers put it there to import this file). The names below are this module's API, re-exported.
from book.chapters import cmd_outputs, cmd_snippets, snippet_source
from book.check import cmd_check, new_tests
from book.diffs import cmd_bugs, cmd_diff, cmd_tree
from book.markers import Block, ExerciseMarker, MarkerError, blocks, depth_errors, is_history, lex
from book.registry import Fix, load_registry
from book.running import TEST_TIMEOUT, run_pytest, stage_import_errors
from book.stages import _build, build_stage, find_exercises, load_book, render, stage_text
from book.transcripts import shown_matches

__all__ = ["Block", "ExerciseMarker", "Fix", "MarkerError", "TEST_TIMEOUT", "_build", "blocks", "build_stage",
           "depth_errors", "find_exercises", "is_history", "lex", "load_book", "load_registry", "main",
           "new_tests", "render", "run_pytest", "shown_matches", "snippet_source", "stage_import_errors",
           "stage_text"]

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steps.py", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the book's root (default: this repository)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "diff", "tree", "bugs"):
        sub.add_parser(name).add_argument("chapter", type=int)
    sub.choices["diff"].add_argument("--code", action="store_true", help="only code: no chapters/, no prose")
    check = sub.add_parser("check")
    check.add_argument("--chapters", help="the stages to check, e.g. 1-3 or 2,5 (default: all)")
    check.add_argument("--no-proofs", action="store_true", help="skip the revert proofs")
    check.add_argument("--timeout", type=float, default=300, help="seconds per example or proof run")
    sub.add_parser("snippets").add_argument("--write", action="store_true", help="rewrite the blocks")
    outputs = sub.add_parser("outputs")
    outputs.add_argument("--chapters", help="the chapters whose transcripts to run (default: all)")
    outputs.add_argument("--timeout", type=float, default=300, help="seconds per command")
    for p in sub.choices.values():  # `--root` may also follow the command
        p.add_argument("--root", type=Path, default=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.command == "check":
            return cmd_check(root, args.chapters, not args.no_proofs, args.timeout)
        if args.command == "build":
            print(build_stage(root, args.chapter, root / "build" / "stages" / f"ch{args.chapter:02d}"))
            return 0
        book = load_book(root)
        if args.command == "snippets":
            return cmd_snippets(book, args.write)
        if args.command == "outputs":
            return cmd_outputs(book, args.chapters, args.timeout)
        if args.command == "diff":
            return cmd_diff(book, args.chapter, args.code)
        return {"tree": cmd_tree, "bugs": cmd_bugs}[args.command](book, args.chapter)
    except MarkerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
