"""practice/workspace/ and an exercise's workspace there: its chapter's stage, its region stubbed, and
the regions of the chapter's later exercises in the same file stubbed too."""

from __future__ import annotations

import difflib
from pathlib import Path

import steps  # tools/steps.py: importing judging put tools/ on the path

from . import JudgeError
from .exercises import Exercise


def workspace(root: Path) -> Path:
    return root / "practice" / "workspace"


def held_back(root: Path, ex: Exercise) -> list[str]:
    """The exercises after `ex` in its chapter whose regions are in the file it edits. Its workspace lays
    them as stubs too, so that the file the learner edits holds no answer of an exercise still to come
    (17.1's radix.py holds 17.2's `RadixCache.problems`). The regions of earlier exercises, and of other
    files, stay whole: the engine that the tests run needs them (16.2's receive step runs every request),
    and what an earlier exercise asked the learner has written already."""
    markers = steps.find_exercises(root)
    if (own := markers.get(ex.id)) is None:
        return []
    later = [m.id for m in markers.values() if m.path == own.path and m.id != ex.id
             and int(m.id.split(".")[0]) == ex.chapter and int(m.id.split(".")[1]) > ex.order[1]]
    return sorted(later, key=lambda i: int(i.split(".")[1]))


def lay_workspace(root: Path, ex: Exercise, dest: Path, *, answer: bool = False) -> Path:
    """Exercise `ex`'s workspace in dest: its chapter's stage with its region stubbed (with `answer`,
    its reference kept: what `check` proves its tests pass on) and the regions of held_back(ex) too."""
    stage = steps.build_stage(root, ex.chapter, dest, stub=None if answer else ex.id)
    if (later := held_back(root, ex)):
        rel = str(steps.find_exercises(root)[ex.id].path)
        book = steps.load_book(root)
        stubs = ([] if answer else [ex.id]) + later
        stubbed = [steps.stage_text(book, rel, ex.chapter, stub=other) for other in stubs]
        (stage / rel).write_text(overlay(steps.stage_text(book, rel, ex.chapter), stubbed))
    return stage


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
