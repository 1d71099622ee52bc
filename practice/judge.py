"""The exercise judge: stubs from the reference, tests, hints and progress (rustlings + nbgrader).

An exercise is a solution region in the source, between `# >>> exercise NN.K: title` and
`# <<< exercise NN.K` (tools/README.md has the marker grammar), listed in practice/exercises.toml
with the tests that must pass and the hints to give:

    python practice/judge.py list              # every exercise, in order, with your progress
    python practice/judge.py start 01.1        # chapter 01's tree, stubbed, in practice/workspace/01.1/
    python practice/judge.py test 01.1         # run its tests there: what failed, then a hint
    python practice/judge.py test 01.1 --verbose   # ... with pytest's whole output
    python practice/judge.py hint 01.1         # the next hint, for the test that failed last
    python practice/judge.py hint 01.1 --solution  # the last hint, which is the solution (--all: every hint)
    python practice/judge.py check             # the author's (CI): stubs fail, references pass

Stages are built by tools/steps.py; `--root DIR` points every command at another book (the tools'
own tests use a small fixture book). Progress lives in ROOT/practice/workspace/progress.json.

A hint is a string, or a table `{ text = "...", when = "..." }` (`when` may be a list of strings): a
hint with `when` belongs to a failure whose test's node id or error text (its message, the failing
line, the error's lines) contains one of them, and is given first for it, the first failure's first.
The last hint of an exercise is its solution: `hint` and `test` never give it; `hint ID --solution`
(or `--all`) does, and `check` refuses a hint before it that holds a piece of the reference's code.

This file is the command line (`parser`, `main`); the rest is the package practice/judging/ beside
it, a module per concern (tools/README.md: "Where the code is"). The names tests/tools/test_judge.py
and others use are re-exported here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

# practice/judging/ is a package beside this file: practice/ is on the path when this file runs as a
# script, not when it is imported by its path (as tests/tools/test_judge.py does), so it is put there.
# Importing judging puts tools/ on the path, for `import steps`. The names below are this module's API.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from judging import REPO, JudgeError  # noqa: E402
from judging.check import (Verdict, check_structure, cmd_check, prove_references,  # noqa: E402
                           prove_stub, reference_code, report)
from judging.commands import cmd_hint, cmd_list, cmd_start, cmd_test  # noqa: E402
from judging.console import console  # noqa: E402
from judging.exercises import Exercise, Hint, find_exercise, load_exercises  # noqa: E402
from judging.failures import SECTION_HEAD, Failure, covers, parse_failures, run_tests  # noqa: E402
from judging.hints import giveaways, next_clue  # noqa: E402
from judging.progress import load_progress, save_progress, status  # noqa: E402
from judging.workspace import (held_back, lay_workspace, overlay, stub_line, without_solutions,  # noqa: E402
                               workspace)
import steps  # noqa: E402  (tools/steps.py; importing judging put tools/ on the path)

__all__ = ["Exercise", "Failure", "Hint", "JudgeError", "REPO", "SECTION_HEAD", "Verdict",
           "check_structure", "cmd_check", "cmd_hint", "cmd_list", "cmd_start", "cmd_test",
           "console", "covers", "find_exercise", "giveaways", "held_back", "lay_workspace",
           "load_exercises", "load_progress", "main", "next_clue", "overlay", "parse_failures",
           "parser", "prove_references", "prove_stub", "reference_code", "report", "run_tests",
           "save_progress", "status", "stub_line", "without_solutions", "workspace"]


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="the book's root (default: the repository holding this file)")
    main = argparse.ArgumentParser(prog="judge.py", description=__doc__.split("\n")[0],
                                   parents=[common])
    commands = main.add_subparsers(dest="command", required=True)
    commands.add_parser("list", parents=[common], help="every exercise and your progress")
    start = commands.add_parser("start", parents=[common], help="lay the stub in practice/workspace/ID/")
    start.add_argument("id")
    start.add_argument("--force", action="store_true", help="replace an existing workspace (your work!)")
    test = commands.add_parser("test", parents=[common], help="run the exercise's tests in its workspace")
    test.add_argument("id")
    test.add_argument("--chapter", action="store_true", dest="whole_stage",
                      help="also every other test of the chapter's stage")
    test.add_argument("--verbose", "-v", action="store_true", help="also pytest's whole output")
    hint = commands.add_parser("hint", parents=[common],
                               help="the next hint (for the tests that failed last); never the solution")
    hint.add_argument("id")
    reveal = hint.add_mutually_exclusive_group()
    reveal.add_argument("--solution", action="store_true", help="the last hint: the solution")
    reveal.add_argument("--all", action="store_true", dest="show_all", help="every hint, the solution last")
    check = commands.add_parser("check", parents=[common],
                                help="the author's check: stubs fail, references pass")
    check.add_argument("ids", nargs="*", metavar="ID", help="only these exercises' stubs and references")
    check.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="pytest runs at once")
    check.add_argument("--stage-tests-passed", type=chapter_list, default=set(), metavar="N,N,...",
                       help="chapters whose stage tests passed just now (tools/steps.py check): the references' "
                            "targets in those chapters' own test files are not run again")
    return main


def chapter_list(text: str) -> set[int]:
    """`3,15,21` -> {3, 15, 21}."""
    try:
        return {int(n) for n in text.split(",") if n}
    except ValueError:
        raise argparse.ArgumentTypeError(f"chapter numbers separated by commas, not {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path(getattr(args, "root", REPO)).resolve()
    try:
        if args.command == "list":
            return cmd_list(root)
        if args.command == "start":
            return cmd_start(root, args.id, args.force)
        if args.command == "test":
            return cmd_test(root, args.id, args.whole_stage, args.verbose)
        if args.command == "hint":
            return cmd_hint(root, args.id, args.show_all, args.solution)
        return cmd_check(root, args.jobs, args.ids, args.stage_tests_passed)
    except (JudgeError, steps.MarkerError, OSError) as error:
        Console(stderr=True, soft_wrap=True, highlight=False).print(f"[red]error:[/] {escape(str(error))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
