"""The chapter registry, chapters/chapters.toml: its chapters, their fixes, rechecks and planted bugs.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .markers import MarkerError

REGISTRY = "chapters/chapters.toml"


@dataclass(frozen=True)
class Fix:
    name: str
    tests: list[str]


@dataclass(frozen=True)
class Bug:
    """A planted bug: `pattern` (exactly once in `file` of the chapter's stage) becomes `replacement`,
    and `tests` must then fail."""
    name: str
    file: str
    pattern: str
    replacement: str
    tests: list[str]


@dataclass(frozen=True)
class Chapter:
    number: int
    slug: str
    title: str
    example: str | None
    tests: list[str]
    fixes: list[Fix] = field(default_factory=list)
    bugs: list[Bug] = field(default_factory=list)
    rechecks: list[Fix] = field(default_factory=list)  # an earlier chapter's fix, reverted in this stage


@dataclass(frozen=True)
class Registry:
    package: str
    chapters: list[Chapter]
    text: str = ""  # the file as written, for line numbers and the stages' copies

    @property
    def numbers(self) -> list[int]:
        return [c.number for c in self.chapters]

    def chapter(self, number: int) -> Chapter:
        found = [c for c in self.chapters if c.number == number]
        if not found:
            raise MarkerError(f"{REGISTRY}:1: unknown chapter {number} (the registry has {self.numbers})")
        return found[0]

    def line_of(self, pattern: str) -> int:
        """The first line matching the regex `pattern`, for error messages (1 if none)."""
        lines = self.text.splitlines()
        return next((i for i, line in enumerate(lines, 1) if re.search(pattern, line)), 1)


def load_registry(root: Path) -> Registry:
    """Parse chapters/chapters.toml; a malformed registry raises MarkerError."""
    if not (Path(root) / REGISTRY).is_file():
        raise MarkerError(f"{REGISTRY}:1: no chapter registry under {root}")
    text = (Path(root) / REGISTRY).read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MarkerError(f"{REGISTRY}: {e}") from None
    if not isinstance(data.get("package"), str):
        raise MarkerError(f'{REGISTRY}:1: needs package = "name"')
    headers = [i for i, line in enumerate(text.splitlines(), 1) if line.strip() == "[[chapter]]"]
    chapters = []
    for i, c in enumerate(data.get("chapter", [])):
        try:
            fixes = [Fix(f["name"], list(f["tests"])) for f in c.get("fix", [])]
            bugs = [Bug(b["name"], b["file"], b["pattern"], b["replacement"],
                        list(b.get("tests", c["tests"]))) for b in c.get("bug", [])]
            rechecks = [Fix(f["name"], list(f["tests"])) for f in c.get("recheck", [])]
            chapters.append(Chapter(int(c["number"]), c["slug"], c["title"], c.get("example"),
                                    list(c.get("tests", [])), fixes, bugs, rechecks))
        except (KeyError, TypeError, ValueError) as e:
            line = headers[i] if i < len(headers) else 1
            raise MarkerError(f"{REGISTRY}:{line}: this chapter (or one of its fixes or bugs) lacks or "
                              f"mistypes {e}") from None
    numbers = [c.number for c in chapters]
    if numbers != sorted(set(numbers)):
        raise MarkerError(f"{REGISTRY}:1: chapter numbers must be unique and ascending, got {numbers}")
    return Registry(data["package"], chapters, text)


def filtered_registry_text(text: str, chapter: int) -> str:
    """chapters.toml as stage `chapter` holds it: the same text without the later chapters."""
    parts = re.split(r"(?m)^(?=\[\[chapter\]\][ \t]*(?:#.*)?$)", text)
    return "".join([parts[0]] + [p for p in parts[1:] if tomllib.loads(p)["chapter"][0]["number"] <= chapter])


def parse_chapters(spec: str | None, numbers: list[int]) -> list[int]:
    """'1-3,5' -> the registry's chapters among 1, 2, 3, 5 (all of them when spec is empty)."""
    wanted: set[int] = set()
    for part in (spec or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            wanted |= set(range(int(lo), int(hi or lo) + 1))
    return [n for n in numbers if not spec or n in wanted]
