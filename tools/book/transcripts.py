"""Transcripts in the chapters: `<!-- output -->` blocks, their commands run as a reader runs them and
what they print compared line by line (tools/README.md: "Transcripts in the chapters").
"""

from __future__ import annotations

import difflib
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .markers import MarkerError
from .running import run_python, stage_env, tail
from .stages import Book

OUTPUT = re.compile(r"^<!-- output(?P<final> final)?(?:: (?P<cmd>\S.*?))? -->\s*$")
NUMERAL = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"   # 7, 0.375, 9,006, -0.2
# in a transcript line: a number that changes from run to run, `~` alone or before the number one run printed
VARIES = re.compile(rf" *~(?:{NUMERAL})? *")
COLUMNS = "80"  # the terminal width transcripts are printed at (rich reads COLUMNS)


class Transcript(NamedTuple):
    """A fenced block that is a command's output: where it is, the command, its lines (the `$` line left out)."""
    line: int                 # the marker's line, 1-based
    command: str
    final_only: bool          # `<!-- output final -->`: what the final tree prints, not the chapter's stage
    shown: list[str]


def fences(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(opening, closing) line indices of every fenced block."""
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
            yield i, end
            i = end
        i += 1


def transcripts(text: str, rel: str) -> tuple[list[Transcript], list[str]]:
    """Every `<!-- output[ final][: COMMAND] -->` block of a chapter, and the errors of the markers."""
    lines, found, errors = text.splitlines(), [], []
    for i, line in enumerate(lines):
        if not line.startswith("<!-- output"):
            continue
        where, m = f"{rel}:{i + 1}", OUTPUT.match(line)
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if m is None:
            errors.append(f"{where}: not a transcript marker: `<!-- output[ final][: COMMAND] -->`")
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```" or end is None:
            errors.append(f"{where}: an output marker must be followed at once by a complete ``` block")
            continue
        block, command = lines[i + 2:end], m["cmd"]
        if block and block[0].startswith("$ "):
            if command is not None and block[0] != f"$ {command}":
                errors.append(f"{where}: the block shows `{block[0]}`, the marker names `{command}`")
                continue
            command, block = block[0][2:], block[1:]
        if command is None:
            errors.append(f"{where}: the marker names no command and the block has no `$ COMMAND` line")
            continue
        found.append(Transcript(i + 1, command, m["final"] is not None, block))
    return found, errors


def command_argv(command: str, tree: Path) -> tuple[list[str], dict[str, str]]:
    """`[NAME=value ...] python SCRIPT [args]`, `SCRIPT.py [args]` or `minioverlap [args]` -> argv and env."""
    words, env = shlex.split(command), {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[:1] == ["python"]:
        words = words[1:]
    if words[:1] == ["minioverlap"]:
        return [sys.executable, "-m", "minioverlap", *words[1:]], env
    if not words or not words[0].endswith(".py"):
        raise MarkerError(f"cannot run `{command}`: a transcript runs `python SCRIPT.py` or `minioverlap`")
    if not (tree / words[0]).is_file():
        raise MarkerError(f"cannot run `{command}`: {words[0]} is not in the tree")
    return [sys.executable, *words], env

_runs: dict[tuple[str, str], subprocess.CompletedProcess] = {}


def run_shown(tree: Path, command: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a transcript's command in a tree (a stage or the book's root) as a reader would, with the tree's
    package first on the path, COLUMNS wide, stdin closed and no GPU (the book's transcripts are a CPU's:
    the same on every machine); remembered, so that one check runs it once."""
    key = (str(Path(tree).resolve()), command)
    if key not in _runs:
        argv, extra = command_argv(command, Path(tree))
        env = {**stage_env(tree), "COLUMNS": COLUMNS, "CUDA_VISIBLE_DEVICES": "", **extra}
        _runs[key] = run_python(argv[1:], Path(tree), env, timeout)   # stdin closed, warm or fresh
    return _runs[key]


def shown_matches(shown: list[str], printed: list[str]) -> bool:
    """Does a transcript match what was printed? Line by line, trailing spaces and blank lines aside; a
    line `...` stands for any number of lines, a `~` or `~12.5` for one number (the spaces beside it for
    any)."""
    def trim(lines: list[str]) -> list[str]:
        lines = [line.rstrip() for line in lines]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def line_pattern(line: str) -> re.Pattern:
        parts = VARIES.split(line)
        number = rf" *{NUMERAL} *"
        return re.compile(number.join(re.escape(p) for p in parts) + r"\Z")

    want, got = trim(shown), trim(printed)
    patterns = [None if line == "..." else line_pattern(line) if "~" in line else line for line in want]
    reach = {0}                                      # how many printed lines the first k shown lines can cover
    for p in patterns:
        if p is None:
            reach = set(range(min(reach), len(got) + 1)) if reach else set()
        else:
            reach = {j + 1 for j in reach if j < len(got)
                     and (p == got[j] if isinstance(p, str) else p.match(got[j]) is not None)}
    return len(got) in reach


def check_transcripts(md: Path, tree: Path, rel: str, *, final: bool, timeout: float | None = None) -> list[str]:
    """Run every transcript's command of one chapter in `tree` and compare: in the chapter's stage
    (`final` False) the blocks that are not `final`-only, in the final tree (the book's root) all of them,
    with the errors of the markers."""
    found, errors = transcripts(md.read_text(), rel)
    errors = errors if final else []
    for t in found:
        if t.final_only and not final:
            continue
        where = f"{rel}:{t.line}: output of `{t.command}` in {'the final tree' if final else 'its stage'}"
        try:
            r = run_shown(tree, t.command, timeout)
        except MarkerError as e:
            errors.append(f"{rel}:{t.line}: {e}")
            continue
        if r.returncode != 0:
            errors.append(f"{where}: exit {r.returncode}\n{tail(r, 10)}")
        elif not shown_matches(t.shown, r.stdout.splitlines()):
            shown, printed = [s.rstrip() for s in t.shown], [s.rstrip() for s in r.stdout.splitlines()]
            diff = list(difflib.unified_diff(shown, printed, "chapter", "printed", lineterm="", n=1))
            errors.append(f"{where}: differs\n" + "\n".join(diff[2:16]))
    return errors


def output_errors(book: Book, rel: str, stage: Path, timeout: float) -> list[str] | None:
    """`check`'s transcripts of one chapter: in its stage (the example's run reused) and in the final
    tree; None if the chapter has none."""
    md = book.root / rel
    if not transcripts(md.read_text(), rel)[0]:
        return None
    return (check_transcripts(md, stage, rel, final=False, timeout=timeout)
            + check_transcripts(md, book.root, rel, final=True, timeout=timeout))
