"""The hints: which one to give next for the tests that failed, giving it, and what a hint before the
solution may not say (giveaways, which `check` applies)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from rich.markup import escape

from .console import _command, _plural, console
from .exercises import Exercise
from .failures import Failure
from .progress import save_progress


def next_clue(ex: Exercise, seen: set[int], failed: list[Failure]) -> int | None:
    """The index of the hint to give next, never the solution. The failures are taken in the order
    they failed; for each, first an unseen hint whose `when` is in its error (what actually went wrong:
    a test named after one bug may fail with another's error), then one whose `when` is in its node id.
    Failing those, the first unseen hint without `when`; with no failure known, the first unseen of all."""
    unseen = [i for i in range(len(ex.clues)) if i not in seen]
    if not failed:
        return unseen[0] if unseen else None
    for failure in failed:
        for text in (failure.error, failure.node):
            found = [i for i in unseen if any(w in text for w in ex.clues[i].when)]
            if found:
                return found[0]
    return next((i for i in unseen if not ex.clues[i].when), None)


def last_failures(entry: dict) -> list[Failure]:
    """The failures of the last `test`, as progress.json keeps them (a node id alone, before)."""
    return [Failure(item, "") if isinstance(item, str) else Failure(item["node"], item.get("error", ""))
            for item in entry.get("last_failed", [])]


def _show_next_hint(root: Path, ex: Exercise, progress: dict[str, dict]) -> None:
    """Give the next hint for the last failure, and remember it was seen."""
    if not ex.hints:
        return
    entry = progress.setdefault(ex.id, {})
    seen = set(entry.get("hints_seen", range(entry.get("hints_shown", 0))))  # hints_shown: a count, before
    index = next_clue(ex, seen, last_failures(entry))
    if index is None:
        given = len(seen & set(range(len(ex.clues))))
        if not ex.clues:
            what = f"exercise {ex.id}: its only hint is its solution"
        elif given < len(ex.clues):
            what = f"no more hints for the tests that failed ({given} of {len(ex.clues)} hints seen)"
        else:
            what = f"no more hints for exercise {ex.id}: all {_plural(len(ex.clues), 'hint')} seen"
        command = escape(_command(root, "hint", ex.id))
        console.print(f"{what}. The solution: `{command} --solution`; every hint and the solution: "
                      f"`{command} --all`")
        return
    entry["hints_seen"] = sorted(seen | {index})
    entry.pop("hints_shown", None)
    save_progress(root, progress)
    _print_hint(ex, index)


def _print_hint(ex: Exercise, index: int) -> None:
    hint = ex.clues[index]
    console.print(f"[cyan]hint {index + 1}/{len(ex.clues)}[/] for {ex.id}{escape(hint.label(ex.tests))}: "
                  f"{escape(hint.text)}")


def giveaways(text: str, code: list[str]) -> list[str]:
    """The pieces of the reference `code` that a hint's `text` holds, spaces, quotes and `self.` not
    counted: a whole statement, an `if` with its body included (but a bare call, which only names what
    to call, and a statement of one operand, such as `return None`), or an expression of three operands
    or more (names and constants; a called function's own name is not one), such as
    `seq_len + 2 * window`. A hint may name the functions and fields to use; it must not write the code
    that combines them."""
    source = textwrap.dedent("\n".join(code))
    try:
        tree = ast.parse(source)
    except SyntaxError:   # not Python (a region of another language): its lines, whole
        return [line.strip() for line in source.splitlines()
                if len(_flat(line)) >= 10 and not line.strip().startswith("#") and _flat(line) in _flat(text)]
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):   # an `if` with its body, an assignment, a return
            bare_call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            piece = _operands(node) >= 2 and not bare_call
        else:
            piece = (isinstance(node, ast.expr) and _operands(node) >= 3
                     and not isinstance(node, (ast.Name, ast.Attribute, ast.Constant, ast.Starred)))
        segment = ast.get_source_segment(source, node) if piece else None
        if segment and _flat(segment) in _flat(text):
            found.setdefault(_flat(segment), " ".join(segment.split()))
    # a piece inside a longer one that the hint holds too is not named again
    return [shown for flat, shown in found.items()
            if not any(flat != other and flat in other for other in found)]


def _operands(node: ast.AST) -> int:
    """The names and constants of an expression or statement, a called function's own name not counted."""
    callees = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return sum(isinstance(n, (ast.Name, ast.Constant)) and id(n) not in callees for n in ast.walk(node))


def _flat(code: str) -> str:
    """Code compared as written: without spaces, with one kind of quote, without `self.`."""
    return re.sub(r"\s+", "", code).replace("'", '"').replace("self.", "")
