"""The console the commands print to, and the wording of what they print: counts, paths, commands."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from . import REPO

console = Console(soft_wrap=True, highlight=False)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _command(root: Path, *words: str) -> str:
    base = "python practice/judge.py"
    if root.resolve() != REPO:
        base += f" --root {root}"
    return " ".join([base, *words])
