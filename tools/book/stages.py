"""The book (the registry and every staged file, parsed and checked together) and building a stage:
the tree as of one chapter, markers gone and old code restored where due.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .markers import (Block, ExerciseMarker, MarkerError, Source, blocks, layout_errors,
                      parse_source)
from .registry import REGISTRY, Registry, filtered_registry_text, load_registry

STAGED = ("tests", "examples", "chapters", "practice")  # and the package folder
NOT_STAGED = ("tests/tools", "practice/workspace")
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".mypy_cache", ".ruff_cache"}
PROSE = (".md", ".rst", ".txt")  # what `diff --code` leaves out, with chapters/

NAMED = {"tests": re.compile(r"test_ch(\d+)_.*\.py$"), "examples": re.compile(r"ch(\d+)_"),
         "chapters": re.compile(r"(\d+)-.*\.md$")}


# ---------------------------------------------------------------- the book: registry + sources

@dataclass
class Book:
    root: Path
    registry: Registry
    files: dict[str, int]  # every staged path -> the chapter it arrives in
    sources: dict[str, Source]  # the .py files, parsed


def source_paths(root: Path, package: str) -> list[str]:
    """Every staged path under root: relative, posix, sorted."""
    out = []
    for top in (package, *STAGED):
        for dirpath, dirnames, filenames in os.walk(root / top):
            here = Path(dirpath).relative_to(root).as_posix()
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                           and f"{here}/{d}" not in NOT_STAGED]
            out += [f"{here}/{f}" for f in filenames if not f.endswith(".pyc")]
    return sorted(out)


def file_chapter(rel: str, source: Source | None, first: int) -> int:
    """The chapter a file arrives in: from its name, else its file marker, else the first chapter."""
    top, name = rel.split("/")[0], rel.rsplit("/", 1)[-1]
    if top in NAMED and (m := NAMED[top].match(name)):
        return int(m[1])
    return source.chapter if source and source.chapter is not None else first


def load_book(root: Path) -> Book:
    """Load the registry and parse every staged file; MarkerError lists every error at once."""
    root = Path(root).resolve()
    registry = load_registry(root)
    errors: list[str] = []
    files, sources = {}, {}
    for rel in source_paths(root, registry.package):
        if rel.endswith(".py"):
            text = (root / rel).read_text()
            sources[rel], found = parse_source(text, rel)
            errors += found + layout_errors(text, sources[rel])
        files[rel] = file_chapter(rel, sources.get(rel), (registry.numbers or [1])[0])
    book = Book(root, registry, files, sources)
    errors += marker_errors(book) + registry_errors(book) + bug_errors(book)
    if errors:
        raise MarkerError(f"{len(errors)} structural error(s):\n" + "\n".join(errors), errors)
    return book


def marker_errors(book: Book) -> list[str]:
    """Known chapters, nesting that only moves forward, unique exercises, fixes the registry names."""
    known, errors = set(book.registry.numbers), []
    errors += [f"{rel}:1: unknown chapter ch{n:02d} (the registry has {sorted(known)})"
               for rel, n in book.files.items() if n not in known]
    outer_of = {}  # block -> the chapter of the code around it
    for rel, source in book.sources.items():
        _outer(source.nodes, book.files[rel], outer_of)
    seen: dict[str, str] = {}
    registered = {f.name: c.number for c in book.registry.chapters for f in c.fixes}
    for b, outer in outer_of.items():
        where, label = f"{b.path}:{b.line}", b.head.removeprefix("# >>> ")
        errors += [f"{where}: unknown chapter ch{n:02d} in '{label}' (the registry has {sorted(known)})"
                   for n in (b.chapter, b.replaces) if n is not None and n not in known]
        if b.replaces is not None and b.replaces >= b.chapter:
            errors.append(f"{where}: ch{b.chapter:02d} {b.kind} ch{b.replaces:02d}: it must "
                          f"{b.kind.removesuffix('s')} an earlier chapter")
        if min(b.chapter, b.replaces or b.chapter) < outer:
            errors.append(f"{where}: '{label}' sits inside ch{outer:02d} code: an inner chapter must be "
                          f">= the outer one")
        if b.exercise and b.exercise in seen:
            errors.append(f"{where}: exercise {b.exercise} is already marked at {seen[b.exercise]}")
        elif b.exercise:
            seen[b.exercise] = where
        if b.fix and registered.get(b.fix) != b.chapter:
            elsewhere = f" (it names it in ch{registered[b.fix]:02d})" if b.fix in registered else ""
            errors.append(f"{where}: fix '{b.fix}' is not in the registry for ch{b.chapter:02d}{elsewhere}")
    used = {b.fix for b in outer_of}
    for name, number in registered.items():
        if name not in used:
            line = book.registry.line_of(rf"name\s*=\s*[\"']{re.escape(name)}[\"']")
            errors.append(f"{REGISTRY}:{line}: fix '{name}' of ch{number:02d} has no marker in the source")
    return errors


def _outer(nodes: list[Block | str], outer: int, out: dict[Block, int]) -> None:
    for b in nodes:
        if isinstance(b, Block):
            out[b] = outer
            _outer(b.body, outer if b.exercise else b.chapter, out)  # a region keeps its code's chapter


def registry_errors(book: Book) -> list[str]:
    """Every registry test, fix test and example exists and arrives no later than its chapter."""
    errors, fixed_in = [], {f.name: c.number for c in book.registry.chapters for f in c.fixes}
    for c in book.registry.chapters:
        named = [t for f in c.fixes + c.rechecks for t in f.tests] + [t for b in c.bugs for t in b.tests]
        for f in c.rechecks:
            if fixed_in.get(f.name, c.number) >= c.number:
                line = book.registry.line_of(rf"name\s*=\s*[\"']{re.escape(f.name)}[\"']")
                errors.append(f"{REGISTRY}:{line}: ch{c.number:02d} rechecks '{f.name}', which is no fix of an "
                              "earlier chapter")
        for ref in dict.fromkeys([c.example] * bool(c.example) + c.tests + named):
            rel, where = ref.split("::")[0], f"{REGISTRY}:{book.registry.line_of(re.escape(ref))}"
            if rel not in book.files:
                errors.append(f"{where}: ch{c.number:02d} names {rel}, which is not in the source tree")
            elif book.files[rel] > c.number:
                errors.append(f"{where}: ch{c.number:02d} names {rel}, which arrives in "
                              f"ch{book.files[rel]:02d}: stage {c.number:02d} lacks it")
    return errors


def bug_errors(book: Book) -> list[str]:
    """Every planted bug has a unique name and a pattern found exactly once in its file of the stage."""
    errors, seen = [], set()
    for c in book.registry.chapters:
        for bug in c.bugs:
            line = book.registry.line_of(rf"name\s*=\s*[\"']{re.escape(bug.name)}[\"']")
            where, what = f"{REGISTRY}:{line}", f"bug '{bug.name}' of ch{c.number:02d}"
            if bug.name in seen:
                errors.append(f"{where}: {what}: the name is already taken")
            seen.add(bug.name)
            if book.files.get(bug.file, c.number + 1) > c.number:
                errors.append(f"{where}: {what}: stage {c.number:02d} has no {bug.file}")
            elif (count := stage_text(book, bug.file, c.number).count(bug.pattern)) != 1:
                errors.append(f"{where}: {what}: its pattern {bug.pattern!r} occurs {count} times in "
                              f"{bug.file} of stage {c.number:02d}; it must occur exactly once")
            elif bug.pattern == bug.replacement:
                errors.append(f"{where}: {what}: the replacement equals the pattern")
    return errors


def find_exercises(root: Path) -> dict[str, ExerciseMarker]:
    """Every `# >>> exercise NN.K: title` region of the staged sources, by id."""
    book = load_book(root)
    return {b.exercise: ExerciseMarker(b.exercise, b.title, b.chapter, Path(b.path), b.line)
            for s in book.sources.values() for b in blocks(s.nodes) if b.exercise}


# ---------------------------------------------------------------- building a stage

def render(nodes: list[Block | str], chapter: int, revert: str | None, stub: str | None,
           stubbed: set[str]) -> list[str]:
    """The lines of a parsed file as of `chapter`: markers gone, old code restored where due."""
    out: list[str] = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif node.exercise and node.exercise == stub and node.start is not None:
            out.append(f"{node.indent}# exercise {node.exercise}: {node.title} (this is chapter {node.start:02d}'s code)")
            out += render(node.body, node.start, revert, None, stubbed)
            stubbed.add(stub)
        elif node.exercise and node.exercise == stub:
            message = json.dumps(f"exercise {node.exercise}: {node.title}", ensure_ascii=False)
            out.append(f"{node.indent}raise NotImplementedError({message})")
            stubbed.add(stub)
        elif node.exercise or (chapter >= node.chapter and not (revert and node.fix == revert)):
            out += render(node.body, chapter, revert, stub, stubbed)
        elif node.replaces is not None and chapter >= node.replaces:
            out += node.old
    return out


def tidy(lines: list[str]) -> list[str]:
    """Squeeze the blank runs that dropped blocks leave: at most two in a row, none at the end."""
    out: list[str] = []
    for line in lines:
        if line.strip() or len(out) < 2 or out[-1].strip() or out[-2].strip():
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def build_stage(root: Path, chapter: int, dest: Path, *, revert: str | None = None,
                stub: str | None = None) -> Path:
    """Write the tree as of `chapter` to dest (deleting dest first) and return dest; `revert` names a
    fix to take back out, `stub` an exercise whose region becomes `raise NotImplementedError`."""
    return _build(load_book(root), chapter, Path(dest), revert=revert, stub=stub)


def stage_text(book: Book, rel: str, chapter: int, *, revert: str | None = None, stub: str | None = None,
               stubbed: set[str] | None = None) -> str:
    """One file's text as stage `chapter` holds it (the file must arrive by then)."""
    if (source := book.sources.get(rel)) is not None:
        lines = tidy(render(source.nodes, chapter, revert, stub, set() if stubbed is None else stubbed))
        return "\n".join(lines) + "\n" * (bool(lines) and source.trailing_newline)
    if rel == REGISTRY:
        return filtered_registry_text(book.registry.text, chapter)
    return (book.root / rel).read_text()


def _build(book: Book, chapter: int, dest: Path, *, revert: str | None = None,
           stub: str | None = None) -> Path:
    book.registry.chapter(chapter)
    fixes = [b for s in book.sources.values() for b in blocks(s.nodes) if b.fix == revert]
    if revert is not None and not any(b.chapter <= chapter for b in fixes):
        raise MarkerError(f"stage {chapter:02d} holds no fix '{revert}' to revert")
    dest = dest.resolve()
    if dest == book.root or dest in book.root.parents:
        raise MarkerError(f"refusing to delete {dest}: it holds the source tree")
    shutil.rmtree(dest, ignore_errors=True)
    stubbed: set[str] = set()
    for rel in (rel for rel, arrives in book.files.items() if arrives <= chapter):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel in book.sources or rel == REGISTRY:
            target.write_text(stage_text(book, rel, chapter, revert=revert, stub=stub, stubbed=stubbed))
        else:
            shutil.copy2(book.root / rel, target)
    if stub is not None and stub not in stubbed:
        raise MarkerError(f"exercise {stub} has no region in stage {chapter:02d}")
    return dest


def is_prose(rel: str) -> bool:
    """The chapters' text and registry, and any other prose: what `diff --code` leaves out."""
    return rel.startswith("chapters/") or rel.endswith(PROSE)
