"""The registry practice/exercises.toml: its exercises and their hints, loaded and checked."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import JudgeError

ID_PATTERN = re.compile(r"\d{2}\.\d+")


@dataclass(frozen=True)
class Hint:
    text: str
    when: tuple[str, ...] = ()   # given first for a failure whose node id or error text holds one of these

    def names(self, tests: list[str]) -> list[str]:
        """The strings of `when` that are part of a test's name (the others match an error's text)."""
        return [w for w in self.when if any(w in test for test in tests)]

    def label(self, tests: list[str]) -> str:
        """`(when early_finish fails)`, `(when stale_reply fails, or on `x not in list`)`; "" for none."""
        names = self.names(tests)
        about = [f"when {w} fails" for w in names] + [f"on `{w}`" for w in self.when if w not in names]
        return f" ({', or '.join(about)})" if about else ""


@dataclass(frozen=True)
class Exercise:
    id: str            # "NN.K": the K-th exercise of chapter NN
    title: str
    tests: list[str]   # pytest node ids, relative to the stage root
    hints: list[Hint]  # the last one is the solution

    @property
    def solution(self) -> Hint | None:
        return self.hints[-1] if self.hints else None

    @property
    def clues(self) -> list[Hint]:
        """The hints that `hint` and `test` give: all but the solution."""
        return self.hints[:-1]

    @property
    def chapter(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def order(self) -> tuple[int, int]:
        major, minor = self.id.split(".")
        return int(major), int(minor)


def load_exercises(root: Path) -> list[Exercise]:
    """The exercises of ROOT/practice/exercises.toml, in order (chapter, then K)."""
    path = root / "practice" / "exercises.toml"
    if not path.is_file():
        raise JudgeError(f"no exercise registry: {path} does not exist")
    entries = tomllib.loads(path.read_text()).get("exercise", [])
    exercises = [_exercise(entry, path) for entry in entries]
    seen: set[str] = set()
    for ex in exercises:
        if ex.id in seen:
            raise JudgeError(f"{path}: exercise '{ex.id}' is listed twice")
        seen.add(ex.id)
    return sorted(exercises, key=lambda ex: ex.order)


def _exercise(entry: dict, path: Path) -> Exercise:
    ex_id = entry.get("id")
    if not isinstance(ex_id, str) or not ID_PATTERN.fullmatch(ex_id):
        raise JudgeError(f"{path}: exercise id {ex_id!r} is not of the form 'NN.K' (e.g. '01.2')")
    tests = entry.get("tests", [])
    if not isinstance(tests, list) or not all(isinstance(item, str) for item in tests):
        raise JudgeError(f"{path}: exercise '{ex_id}': tests must be a list of strings")
    hints = entry.get("hints", [])
    if not isinstance(hints, list):
        raise JudgeError(f"{path}: exercise '{ex_id}': hints must be a list")
    return Exercise(ex_id, str(entry.get("title", "")), list(tests), [_hint(h, ex_id, path) for h in hints])


def _hint(item: object, ex_id: str, path: Path) -> Hint:
    """A hint of the registry: a string, or a table with `text` and an optional `when`, a string or a
    list of strings."""
    if isinstance(item, str):
        return Hint(item)
    if isinstance(item, dict) and isinstance(item.get("text"), str) and set(item) <= {"text", "when"}:
        when = item.get("when", [])
        when = [when] if isinstance(when, str) else when
        if isinstance(when, list) and all(isinstance(w, str) for w in when):
            return Hint(item["text"], tuple(w for w in when if w))
    raise JudgeError(f"{path}: exercise '{ex_id}': a hint must be a string or {{ text = \"...\", "
                     f"when = \"part of a test's name or of its error\" (or a list of them) }}, got {item!r}")


def find_exercise(exercises: list[Exercise], ex_id: str) -> Exercise:
    """The exercise `ex_id` ("2.1" reads as "02.1"), or an error naming the known ones."""
    chapter, dot, k = ex_id.partition(".")
    wanted = f"{int(chapter):02d}.{k}" if chapter.isdigit() and dot else ex_id
    for ex in exercises:
        if ex.id == wanted:
            return ex
    known = ", ".join(ex.id for ex in exercises) or "none"
    raise JudgeError(f"unknown exercise '{ex_id}': known are {known}")
