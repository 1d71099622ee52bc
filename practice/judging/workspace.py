"""practice/workspace/ and an exercise's workspace there: its chapter's stage, its region stubbed, the
region of every later exercise that the stage holds stubbed too, and its copy of the registry without
the solutions."""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path

import steps  # tools/steps.py: importing judging put tools/ on the path
from book.stages import Book  # tools/book/, beside it

from . import JudgeError
from .exercises import Exercise


def workspace(root: Path) -> Path:
    return root / "practice" / "workspace"


def _order(ex_id: str) -> tuple[int, int]:
    major, minor = ex_id.split(".")
    return int(major), int(minor)


def held_back(book: Book, ex: Exercise) -> dict[str, list[str]]:
    """{file: the exercises after `ex` whose regions in it `ex`'s stage holds}, in order. A learner's
    workspace holds no answer of an exercise still to come, so these are laid as their own stubs too:
    every later exercise of its chapter, whatever its file (16.1's workspace would hold 16.2's receive
    step in scheduler.py, 17.1's radix.py 17.2's `RadixCache.problems`). A later chapter's exercise
    whose region the stage already holds is code an earlier chapter wrote and the engine runs there
    (handle_window: chapter 09 runs it, exercise 12.1 has it written again where the overlap loop makes
    it matter): stubbed, it would stop every step of the stage, so it stays. The regions of earlier
    exercises stay whole: what an earlier exercise asked the learner has written already."""
    later: dict[str, list[str]] = {}
    for rel, source in book.sources.items():
        if book.files[rel] > ex.chapter:
            continue
        for block in steps.blocks(source.nodes):
            if not block.exercise or _order(block.exercise) <= ex.order or _order(block.exercise)[0] > ex.chapter:
                continue
            found: set[str] = set()   # the region is in the stage: rendering it there reaches it
            steps.stage_text(book, rel, ex.chapter, stub=block.exercise, stubbed=found)
            if block.exercise in found:
                later.setdefault(rel, []).append(block.exercise)
    return {rel: sorted(ids, key=_order) for rel, ids in later.items()}


def lay_workspace(root: Path, ex: Exercise, dest: Path, *, answer: bool = False,
                  book: Book | None = None) -> Path:
    """Exercise `ex`'s workspace in dest: its chapter's stage with its region stubbed (with `answer`,
    its reference kept: what `check` proves its tests pass on) and the regions of held_back(ex) too.
    `book`: the source, already loaded (load_book), for callers that lay many."""
    book = book or steps.load_book(root)
    stage = steps._build(book, ex.chapter, dest, stub=None if answer else ex.id)
    own = None if answer else next(str(b.path) for s in book.sources.values()
                                   for b in steps.blocks(s.nodes) if b.exercise == ex.id)
    for rel, later in held_back(book, ex).items():
        stubs = [ex.id] * (rel == own) + later
        stubbed = [steps.stage_text(book, rel, ex.chapter, stub=other) for other in stubs]
        (stage / rel).write_text(overlay(steps.stage_text(book, rel, ex.chapter), stubbed))
    if (registry := stage / "practice" / "exercises.toml").is_file():
        registry.write_text(without_solutions(registry.read_text()))
    return stage


def without_solutions(text: str) -> str:
    """practice/exercises.toml as a workspace holds it: every exercise's last hint, its solution, replaced
    by where to ask for it. The stage copies the registry whole, every chapter's solutions in it; a
    learner's tree holds no answer (`hint NN.K --solution` gives it, when they decide to look)."""
    def toml(value: object) -> str:        # a JSON string or list of strings is TOML too
        if isinstance(value, dict):
            return "{ " + ", ".join(f"{key} = {toml(item)}" for key, item in value.items()) + " }"
        return json.dumps(value, ensure_ascii=False)

    out = ["# The exercises of practice/exercises.toml, each one's solution left out: run",
           "# `python practice/judge.py hint NN.K --solution` in the repository for it.", ""]
    for entry in tomllib.loads(text).get("exercise", []):
        hints = list(entry.get("hints", []))
        if hints:
            hints[-1] = f"the solution: python practice/judge.py hint {entry.get('id')} --solution"
        out += ["[[exercise]]"] + [f"{key} = {toml(value)}" for key, value in entry.items() if key != "hints"]
        out += ["hints = ["] + [f"    {toml(hint)}," for hint in hints] + ["]", ""]
    return "\n".join(out)


def overlay(base: str, variants: list[str]) -> str:
    """`base` with the changes of every variant laid over it: each variant is base with one region of its
    own changed (a stub), and the regions do not overlap."""
    lines = base.splitlines(keepends=True)
    edits = []
    for text in variants:
        new = text.splitlines(keepends=True)
        opcodes = difflib.SequenceMatcher(None, lines, new, autojunk=False).get_opcodes()
        edits += [(i1, i2, new[j1:j2]) for tag, i1, i2, j1, j2 in opcodes if tag != "equal"]
    edits.sort(key=lambda edit: edit[:2])
    if any(later[0] < earlier[1] for earlier, later in zip(edits, edits[1:])):
        raise JudgeError("two exercise regions of one file overlap: their stubs cannot both be laid")
    for i1, i2, new in reversed(edits):
        lines[i1:i2] = new
    return "".join(lines)


def stub_line(stage: Path, rel: str, ex_id: str) -> int | None:
    """The line of the stub's raise in the stage's file, or None once the learner replaced it."""
    path = stage / rel
    if not path.is_file():
        return None
    needles = (f'NotImplementedError("exercise {ex_id}:', f"# exercise {ex_id}: ")   # a stub, or code to repair
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if any(needle in line for needle in needles):
            return number
    return None
