"""The step checker: one annotated source, a working tree for every chapter.

minioverlap/ holds the final engine. Markers in the source (`# >>> ch06: ...` / `# <<< ch06`) say
when each block arrives; this tool derives the tree as of any chapter (a *stage*) and proves that
every stage works: its tests pass, its example runs, every regression test catches the bug it was
written for, the tests catch every bug planted in the registry, every snippet in the chapters
equals its stage's source, every transcript is what its command prints, and every figure the prose
quotes from a recorded run (chapters/figures/*.json) or a transcript is the number there. It also
holds the source to rules that keep it readable as chapters pile up. tools/README.md holds the
grammar; this file is the splitter and the checker.

    python tools/steps.py build N                  # build/stages/chNN/
    python tools/steps.py check [--chapters 1-3] [--no-proofs]
    python tools/steps.py diff N [--code] | tree N | bugs N | snippets [--write] | outputs [--chapters 9-14]

practice/judge.py imports it (`sys.path.insert(0, "tools"); import steps`) for load_registry,
build_stage, find_exercises and run_pytest, and load_book, blocks and render to read an exercise's
reference region.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tokenize
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = "chapters/chapters.toml"
STAGED = ("tests", "examples", "chapters", "practice")  # and the package folder
NOT_STAGED = ("tests/tools", "practice/workspace")
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".mypy_cache", ".ruff_cache"}
PROSE = (".md", ".rst", ".txt")  # what `diff --code` leaves out, with chapters/
TEST_TIMEOUT = 300  # seconds per test in a stage, as [tool.pytest.ini_options] timeout in pyproject.toml
WORKERS = 2  # pytest-xdist workers for a stage's tests (the CI machine has 2 cores)

MARKER = re.compile(r"^(?P<indent>[ \t]*)# (?P<dir>>>>|<<<) (?P<body>.*?)\s*$")
LOOKS_LIKE_MARKER = re.compile(r"^[ \t]*#\s*(>>>|<<<)")
OLD_LINE = re.compile(r"^[ \t]*#\|(?P<rest>.*)$")
OPEN_CH = re.compile(r"ch(?P<ch>\d+)(?: fix (?P<fix>[\w.-]+))?(?: (?P<kind>replaces|removes) ch(?P<old>\d+))?"
                     r":(?: (?P<text>.*))?$")
OPEN_FILE = re.compile(r"ch(?P<ch>\d+) file:(?: .*)?$")
OPEN_EXERCISE = re.compile(r"exercise (?P<id>(?P<ch>\d+)\.\d+)(?: from ch(?P<start>\d+))?: (?P<title>\S.*)$")
CLOSE = re.compile(r"ch(?P<ch>\d+)$|exercise (?P<id>\d+\.\d+)$")
SNIPPET = re.compile(r"^<!-- snippet: (?P<ref>\S+)(?: stub (?P<stub>\d+\.\d+))? -->\s*$")
NAMED = {"tests": re.compile(r"test_ch(\d+)_.*\.py$"), "examples": re.compile(r"ch(\d+)_"),
         "chapters": re.compile(r"(\d+)-.*\.md$")}


class MarkerError(ValueError):
    """A structural error (markers, registry, stage); each message starts `file:line:`."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or [message]


# ---------------------------------------------------------------- the registry

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


# ---------------------------------------------------------------- markers

@dataclass(eq=False)
class Block:
    """One `# >>>` ... `# <<<` region: a chapter block or an exercise's solution region."""
    path: str
    line: int
    indent: str
    chapter: int
    exercise: str | None = None  # "02.1" for a solution region
    start: int | None = None  # `exercise NN.K from chMM`: the stub is the region's code as of chapter MM
    title: str = ""
    fix: str | None = None
    replaces: int | None = None  # the chapter whose code a `replaces` or `removes` block takes out
    removes: bool = False  # `removes`: a `replaces` block with nothing new, only `#|` lines
    old: list[str] = field(default_factory=list)  # the `#|` lines, uncommented
    body: list[Block | str] = field(default_factory=list)

    @property
    def head(self) -> str:
        return f"# >>> exercise {self.exercise}" if self.exercise else f"# >>> ch{self.chapter:02d}"

    @property
    def kind(self) -> str:
        return "removes" if self.removes else "replaces"


@dataclass
class Source:
    """A parsed .py file: its file marker's chapter (if any) and its tree of lines and blocks."""
    path: str
    chapter: int | None
    nodes: list[Block | str]
    trailing_newline: bool


class ExerciseMarker(NamedTuple):
    id: str
    title: str
    chapter: int
    path: Path  # relative to the root
    line: int


def blocks(nodes: list[Block | str]) -> Iterator[Block]:
    for node in nodes:
        if isinstance(node, Block):
            yield node
            yield from blocks(node.body)


def parse_source(text: str, path: str) -> tuple[Source, list[str]]:
    """Parse the markers of one file into a tree; returns it with every balance error found.

    Only comments are markers: a line inside a string is plain text (the rules report it)."""
    nodes: list[Block | str] = []
    stack: list[Block] = []
    errors: list[str] = []
    file_chapter, old_of = None, None  # old_of: the `replaces` block whose `#|` lines may follow
    in_string = lex(text).strings
    for n, line in enumerate(text.splitlines(), 1):
        comment = n not in in_string
        if comment and (m := OLD_LINE.match(line)):
            if old_of is None:
                errors.append(f"{path}:{n}: stray '#|' line: old code may only follow a 'replaces' or "
                              f"'removes' marker")
            else:
                rest = m["rest"][1:] if m["rest"].startswith(" ") else m["rest"]
                old_of.old.append(old_of.indent + rest if rest else "")
            continue
        if old_of is not None and not old_of.old:
            errors.append(f"{path}:{old_of.line}: a '{old_of.kind}' marker needs the old code as '#|' lines")
        old_of = None
        m = MARKER.match(line) if comment else None
        if m is None:
            if comment and LOOKS_LIKE_MARKER.match(line):
                errors.append(f"{path}:{n}: malformed marker {line.strip()!r} (see tools/README.md)")
            else:
                (stack[-1].body if stack else nodes).append(line)
        elif m["dir"] == "<<<":
            _close(m["body"], line.strip(), f"{path}:{n}", stack, errors)
        elif (f := OPEN_FILE.match(m["body"])):
            if n != 1:
                errors.append(f"{path}:{n}: a file marker must be the first line of the file")
            file_chapter = int(f["ch"])
        elif (block := _open(m["body"], path, n, m["indent"])) is None:
            errors.append(f"{path}:{n}: malformed marker {line.strip()!r} (see tools/README.md)")
        else:
            (stack[-1].body if stack else nodes).append(block)
            stack.append(block)
            old_of = block if block.replaces is not None else None
    errors += [f"{path}:{b.line}: '{b.head}' is never closed" for b in stack]
    return Source(path, file_chapter, nodes, text.endswith("\n")), errors


def _open(body: str, path: str, line: int, indent: str) -> Block | None:
    if (e := OPEN_EXERCISE.match(body)):
        return Block(path, line, indent, int(e["ch"]), exercise=e["id"], title=e["title"],
                     start=int(e["start"]) if e["start"] else None)
    if (c := OPEN_CH.match(body)):
        return Block(path, line, indent, int(c["ch"]), fix=c["fix"], title=c["text"] or "",
                     replaces=int(c["old"]) if c["old"] else None, removes=c["kind"] == "removes")
    return None


def _close(body: str, shown: str, where: str, stack: list[Block], errors: list[str]) -> None:
    if (c := CLOSE.match(body)) is None:
        errors.append(f"{where}: malformed marker {shown!r}")
        return
    key = c["id"] or int(c["ch"])
    keys = [b.exercise or b.chapter for b in stack]
    if not stack:
        errors.append(f"{where}: {shown!r} closes nothing: no marker is open")
    elif keys[-1] != key:
        errors.append(f"{where}: {shown!r} closes '{stack[-1].head}' opened at line {stack[-1].line}")
        if key in keys:  # recover: close the matching block and what it holds
            del stack[len(keys) - 1 - keys[::-1].index(key):]
    else:
        stack.pop()


# ---------------------------------------------------------------- the rules that keep the source readable

HISTORY_SHARE = 0.40  # the most of a function's lines that may be markers or kept old code
HISTORY_MIN_LINES = 10  # functions shorter than this are not held to the budget
MAX_DEPTH = 2  # blocks inside blocks, a file marker not counted
Def = ast.FunctionDef | ast.AsyncFunctionDef


class Lexed(NamedTuple):
    """What the tokenizer tells about a file: where strings and statement headers are."""
    strings: set[int]  # lines inside a multi-line string, after its first line
    headers: list[tuple[int, int]]  # (last line of a compound statement's header, its body's first line)
    error: str | None  # why the file does not tokenize, if it does not


def lex(text: str) -> Lexed:
    """Tokenize a file: the lines inside strings and the gap between each header and its body."""
    strings: set[int] = set()
    headers: list[tuple[int, int]] = []
    starts: list[int] = []  # open f-strings (Python 3.12 tokenizes them in parts)
    prev, header = None, None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            kind, (row, _), (end, _) = tok.type, tok.start, tok.end
            if kind == tokenize.STRING:
                strings |= set(range(row + 1, end + 1))
            elif kind == getattr(tokenize, "FSTRING_START", None):
                starts.append(row)
            elif kind == getattr(tokenize, "FSTRING_END", None):
                strings |= set(range(starts.pop() + 1, end + 1))
            if kind == tokenize.NEWLINE and prev is not None and prev.string == ":":
                header = row
            elif header is not None and kind not in (tokenize.COMMENT, tokenize.NL):
                headers.append((header, row))
                header = None
            if kind not in (tokenize.COMMENT, tokenize.NL):
                prev = tok
    except (tokenize.TokenError, SyntaxError) as e:
        return Lexed(strings, headers, str(e))
    return Lexed(strings, headers, None)


def layout_errors(text: str, source: Source) -> list[str]:
    """The rules that keep the final source readable as chapters pile up (tools/README.md)."""
    lexed = lex(text)
    if lexed.error is not None:
        return [f"{source.path}:1: not valid Python, so its markers cannot be checked: {lexed.error}"]
    lines = text.splitlines()
    errors = (header_errors(lines, lexed, source.path) + string_marker_errors(lines, lexed, source.path)
              + depth_errors(source.nodes, 1) + kept_nothing_errors(source)
              + budget_errors(text, lexed, source.path))
    return sorted(errors, key=lambda e: int(e.split(":")[1]))  # in the file's order


def is_history(line: str) -> bool:
    """A chapter marker line or a line of kept old code. An exercise region's markers are no history:
    they mark where a learner's code goes."""
    return bool((LOOKS_LIKE_MARKER.match(line) and "exercise" not in line.split(":")[0])
                or OLD_LINE.match(line))


def header_errors(lines: list[str], lexed: Lexed, path: str) -> list[str]:
    """No marker between a statement's header (`if x:`, `def f():`) and its body."""
    return [f"{path}:{n}: a marker between the header on line {header} and its body: put it before "
            f"the header or inside the body"
            for header, body in lexed.headers for n in range(header + 1, body)
            if LOOKS_LIKE_MARKER.match(lines[n - 1])]


def string_marker_errors(lines: list[str], lexed: Lexed, path: str) -> list[str]:
    """No marker (or `#|` line) inside a string: only comments are markers."""
    return [f"{path}:{n}: {lines[n - 1].strip()!r} inside a string: only a comment can be a marker"
            for n in sorted(lexed.strings) if n <= len(lines) and is_history(lines[n - 1])]


def depth_errors(nodes: list[Block | str], depth: int) -> list[str]:
    """Chapter blocks nest at most MAX_DEPTH deep. An exercise region adds no depth: it is no history,
    it marks where a learner's code goes (the same lines may be two exercises, as 04.2 and 07.1)."""
    errors = []
    for b in (node for node in nodes if isinstance(node, Block)):
        if depth > MAX_DEPTH and not b.exercise:
            errors.append(f"{b.path}:{b.line}: '{b.head.removeprefix('# >>> ')}' is nested {depth} deep "
                          f"(at most {MAX_DEPTH}, a file marker not counted): move it into a helper")
        errors += depth_errors(b.body, depth + (not b.exercise))
    return errors


def has_code(nodes: list[Block | str]) -> bool:
    return any(n.strip() if isinstance(n, str) else has_code(n.body) for n in nodes)


def kept_nothing_errors(source: Source) -> list[str]:
    """A `replaces` block holds new code; a `removes` block holds none (only its `#|` lines)."""
    errors = []
    for b in (b for b in blocks(source.nodes) if b.replaces is not None):
        where, label = f"{b.path}:{b.line}", f"ch{b.chapter:02d} {b.kind} ch{b.replaces:02d}"
        if not b.removes and not has_code(b.body):
            errors.append(f"{where}: '{label}' keeps no new code: a removal is written "
                          f"'ch{b.chapter:02d} removes ch{b.replaces:02d}'")
        elif b.removes and has_code(b.body):
            errors.append(f"{where}: '{label}' holds new code: a 'removes' block holds only '#|' lines "
                          f"(new code is written with 'replaces')")
    return errors


def budget_errors(text: str, lexed: Lexed, path: str) -> list[str]:
    """In a function of HISTORY_MIN_LINES lines or more, at most HISTORY_SHARE of them are history."""
    lines, errors = text.splitlines(), []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as e:
        return [f"{path}:{getattr(e, 'lineno', 1) or 1}: not valid Python, so its functions cannot be "
                f"checked: {e}"]
    for name, node in functions(tree):
        first, last = function_span(node, lines)
        kept = sum(is_history(lines[n - 1]) for n in range(first, last + 1) if n not in lexed.strings)
        size = last - first + 1
        if size >= HISTORY_MIN_LINES and kept > HISTORY_SHARE * size:
            errors.append(f"{path}:{node.lineno}: function {name} spans {size} lines, {kept} of them markers "
                          f"or kept old code ({kept / size:.0%}, at most {HISTORY_SHARE:.0%}): restructure "
                          f"(a helper, a parameter on its own line) rather than stack history")
    return errors


def functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, Def]]:
    """Every def under `node` with its qualified name (`Class.method`, `outer.inner`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, Def):
            yield prefix + child.name, child
        named = isinstance(child, Def | ast.ClassDef)
        yield from functions(child, f"{prefix}{child.name}." if named else prefix)


def function_span(node: Def, lines: list[str]) -> tuple[int, int]:
    """First and last line of a def as written: decorators, and the comments indented under it that
    follow its last statement (a closing marker, say), included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    last = n = node.end_lineno or node.lineno
    while n < len(lines) and (not lines[n].strip() or lines[n].lstrip().startswith("#")):
        if lines[n].strip():
            if len(lines[n]) - len(lines[n].lstrip()) <= node.col_offset:
                break
            last = n + 1
        n += 1
    return first, last


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


# ---------------------------------------------------------------- running things in a stage

def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a command and capture its output; a timeout comes back as exit status 124."""
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f}s\n")


def stage_env(stage: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(stage), "PYTHONDONTWRITEBYTECODE": "1"}


PROCESS_MARK = "process: runs a program in a process of its own (an example, the command line, the notebook)"
LEAVE_OUT_PROCESSES = '''"""tools/steps.py's own plugin for one stage's run: it leaves out the tests marked `process` of the
chapters before {first}; they ran in their own chapter's stage and run again in the last."""
import re


def pytest_collection_modifyitems(config, items):
    def earlier(item):
        number = re.match(r"test_ch(\\d+)_", item.path.name)
        return number is not None and int(number.group(1)) < {first}
    left_out = [item for item in items if item.get_closest_marker("process") and earlier(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
'''


def run_pytest(stage: Path, targets: list[str], *, quiet: bool = True, timeout: float | None = None,
               parallel: bool = False, one_thread: bool = False,
               processes_from: int = 0) -> subprocess.CompletedProcess:
    """Run pytest on `targets` in a stage, importing the stage's package, not an installed one.

    The run is hermetic: an ini file of its own stands in for any pytest config above the stage (a stage
    under the repository would otherwise take the repository's, `pythonpath` included). It holds only
    pytest-timeout's per-test limit, so that a test that hangs fails with its name. `parallel`: one
    pytest-xdist worker per core (at most WORKERS), each with one torch thread, a test file per worker
    so that its module-scoped engines are built once; the tiny model's small operations gain more from
    two processes than from two threads in one. `one_thread`: one torch thread (runs side by side).
    `processes_from`: leave out the `process` tests (examples, the command line) of earlier chapters."""
    stage, env = Path(stage).resolve(), stage_env(stage)
    workers = min(WORKERS, os.cpu_count() or 1) if parallel and importlib.util.find_spec("xdist") else 1
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    if workers > 1 or one_thread:
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="steps-ini-") as tmp:
        (ini := Path(tmp) / "pytest.ini").write_text(f"[pytest]\ntimeout = {TEST_TIMEOUT}\nmarkers =\n    {PROCESS_MARK}\n")
        plugin = []
        if processes_from:
            (Path(tmp) / "steps_stage.py").write_text(LEAVE_OUT_PROCESSES.format(first=processes_from))
            env["PYTHONPATH"] += os.pathsep + tmp
            plugin = ["-p", "steps_stage"]
        cmd = [sys.executable, "-m", "pytest", *targets, *plugin, "-p", "no:cacheprovider", "-c", str(ini),
               "--rootdir", str(stage), "--confcutdir", str(stage), *spread, *["-q"] * quiet]
        return _run(cmd, stage, env, timeout)


def package_error(stage: Path, package: str) -> list[str]:
    """[] if `import package` in the stage finds the stage's own copy."""
    code = f"import {package}; print({package}.__file__)"
    r = _run([sys.executable, "-c", code], stage, stage_env(stage), 120)
    if r.returncode != 0:
        return [f"import {package} fails in the stage:\n{tail(r)}"]
    found = Path(r.stdout.strip().splitlines()[-1]).resolve()
    return [] if stage.resolve() in found.parents else [f"import {package} finds {found}, outside the stage"]


def top_level_names(path: Path) -> set[str] | None:
    """The names a module binds at top level; None if it cannot tell (`import *`, `__getattr__`)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # `try: import x` and friends
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return None if "__getattr__" in names else names


def module_file(stage: Path, dotted: str) -> Path | None:
    """The file (or namespace folder) of module `dotted` in the stage, if it has one."""
    base = stage.joinpath(*dotted.split("."))
    found = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
    return found[0] if found else base if base.is_dir() else None


def stage_import_errors(stage: Path, package: str, chapter: int) -> list[str]:
    """Imports of the stage's own modules (from tests, examples, practice and the package itself) that
    the stage lacks: `import pkg.mod` and `from pkg.mod import Name` (a submodule or top-level name)."""
    stage, errors, ours = Path(stage), [], {package, "tests", "examples", "practice"}
    for py in sorted(stage.rglob("*.py")):
        rel = py.relative_to(stage).as_posix()
        if rel.split("/")[0] not in ours or SKIP_DIRS & set(rel.split("/")):
            continue
        try:
            tree = ast.parse(py.read_text(), rel)
        except SyntaxError as e:
            errors.append(f"{rel}:{e.lineno}: syntax error in stage {chapter:02d}: {e.msg}")
            continue
        for node in ast.walk(tree):
            for module, name in _imports(node, rel):
                if module.split(".")[0] in ours and (what := _missing(stage, module, name)):
                    errors.append(f"{rel}:{node.lineno}: imports {what}, which stage {chapter:02d} lacks")
    return errors


def _imports(node: ast.AST, rel: str) -> list[tuple[str, str | None]]:
    """(module, name) pairs of an import statement, relative imports resolved against `rel`."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    module = node.module or ""
    if node.level:
        module = ".".join(rel.removesuffix(".py").split("/")[:-node.level] + [module] * bool(module))
    return [(module, a.name) for a in node.names]


def _missing(stage: Path, module: str, name: str | None) -> str | None:
    where = module_file(stage, module)
    if where is None:
        return f"module {module}"
    if name in (None, "*") or module_file(stage, f"{module}.{name}"):
        return None
    names = top_level_names(where) if where.is_file() else set()
    return None if names is None or name in names else f"{name} from {module}"


def tail(result: subprocess.CompletedProcess, lines: int = 25, stderr: bool = True) -> str:
    """The last lines of a run's output; stderr=False: of its stdout alone (pytest's summary line, not a
    plugin's warning after it)."""
    text = (result.stdout or "") + ((result.stderr or "") if stderr else "")
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---------------------------------------------------------------- snippets

def snippet_source(stage: Path, ref: str, text: str | None = None) -> list[str]:
    """The lines that `path`, `path::Name` or `path::Class.method` names in a stage: exact source,
    decorators included, methods dedented; `text` is the file's text where it is not the stage's (a stub)."""
    rel, _, name = ref.partition("::")
    if text is None and not (Path(stage) / rel).is_file():
        raise MarkerError(f"{rel} is not in the stage")
    lines = (Path(stage) / rel).read_text().splitlines() if text is None else text.splitlines()
    if not name:
        return lines
    body: list[ast.stmt] = ast.parse("\n".join(lines)).body
    for part in name.split("."):
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next((n for n in body if isinstance(n, defs) and n.name == part), None)
        if node is None:
            raise MarkerError(f"{rel} has no {name} in the stage")
        body = node.body
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return textwrap.dedent("\n".join(lines[start - 1:node.end_lineno])).splitlines()


def stub_text(book: Book, rel: str, chapter: int, exercise: str) -> str:
    """A file of stage `chapter` with exercise `exercise`'s region as the learner gets it: the stub."""
    if rel not in book.sources:
        raise MarkerError(f"{rel} is not in the stage")
    stubbed: set[str] = set()
    text = stage_text(book, rel, chapter, stub=exercise, stubbed=stubbed)
    if exercise not in stubbed:
        raise MarkerError(f"{rel} holds no region of exercise {exercise} in the stage")
    return text


def check_markdown(md: Path, stage: Path, rel: str, book: Book | None = None,
                   chapter: int | None = None) -> tuple[list[str], str]:
    """Compare every snippet block of one chapter with its stage, every figure with its recorded run and
    every quote with the chapter's transcripts (and read the transcripts' markers, which
    check_transcripts runs); returns (errors, the text with the snippets repaired). A snippet
    `REF stub NN.K` shows exercise NN.K's stub, the contract without the answer (it needs `book`)."""
    lines, errors, out, i = md.read_text().splitlines(), [], [], 0
    while i < len(lines):
        out.append(lines[i])
        m, i = SNIPPET.match(lines[i]), i + 1
        if not m:
            continue
        where = f"{rel}:{i}: snippet {m['ref']}"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None or not re.match(r"```(python|py)\s*$", lines[i]):
            errors.append(f"{where}: must be followed at once by a complete ```python block")
            continue
        shown = lines[i + 1:end]
        try:
            if m["stub"] and book is None:
                raise MarkerError("a stub snippet needs the book's source")
            text = stub_text(book, m["ref"].partition("::")[0], chapter, m["stub"]) if m["stub"] else None
            source = snippet_source(stage, m["ref"], text)
        except (MarkerError, SyntaxError) as e:
            errors.append(f"{where}: {e}")
            source = shown
        if shown != source:
            diff = list(difflib.unified_diff(shown, source, "chapter", "stage", lineterm="", n=1))
            errors.append(f"{where}: drifted from the stage's source\n" + "\n".join(diff[2:14]))
        out += [lines[i], *source]
        i = end
    errors += transcripts("\n".join(lines), rel)[1] + figure_errors(lines, stage, rel) + quote_errors(lines, rel)
    return errors, "\n".join(out) + "\n"


def chapter_markdowns(book: Book) -> list[tuple[str, int]]:
    """chapters/NN-*.md with their chapter numbers."""
    return [(rel, n) for rel, n in book.files.items()
            if rel.startswith("chapters/") and NAMED["chapters"].match(rel.rsplit("/", 1)[-1])]


# ---------------------------------------------------------------- transcripts and figures

OUTPUT = re.compile(r"^<!-- output(?P<final> final)?(?:: (?P<cmd>\S.*?))? -->\s*$")
FIG = re.compile(r"<!-- fig: (?P<file>\S+) (?P<rows>rows: )?(?P<exprs>\S.*?) -->")
QUOTE = re.compile(r"<!-- out: (?P<texts>\S.*?) -->")
LOOKS_LIKE_CHECKED = re.compile(r"<!--\s*(output|fig|out)\b")
# a number as prose prints it, whole: 7, 0.375, 9,006, +9, -0.2, 2.4x (a sign only where no word or digit
# precedes it; no part of a word such as H200 or ch09)
NUMERAL = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"   # 7, 0.375, 9,006, -0.2
NUMBER = re.compile(rf"(?<![\w.,]){NUMERAL}(?![\d.,]\d|\d)")
# in a transcript line: a number that changes from run to run, `~` alone or before the number one run printed
VARIES = re.compile(rf" *~(?:{NUMERAL})? *")
FIGURES = "chapters/figures"
COLUMNS = "80"  # the terminal width transcripts are printed at (rich reads COLUMNS)
FUNCTIONS = {"min": min, "max": max, "sum": lambda *v: sum(v), "abs": abs, "mean": lambda *v: sum(v) / len(v)}
OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Div: lambda a, b: a / b}


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
        try:
            _runs[key] = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True,
                                        timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            _runs[key] = subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout:.0f}s\n")
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


def number_value(text: str) -> tuple[float, int]:
    """A number as printed -> its value and its decimals: '9,006' -> (9006.0, 0), '−0.25' -> (-0.25, 2)."""
    text = text.replace(",", "").replace("−", "-")
    return float(text), len(text.partition(".")[2])


def agrees(printed: str, value: float) -> bool:
    """`printed` is `value` at its printed precision (a half-way value may round either way)."""
    shown, decimals = number_value(printed)
    return abs(value - shown) <= 0.5 * 10 ** -decimals * (1 + 1e-9)


class Many(list):
    """The items a filter selected, or one field of each: only min, max, sum and mean take them."""


def select(data, path: str, name: str):
    """Follow `name`, `.key`, `[key]` (a dict) and `[v, k=v, k^=v, k*=v, ...]` (a list's items with a field
    equal to v, field k equal to, starting with, containing v) in JSON data; a filter that matches several
    items gives Many."""
    here = data
    for key, field_ in re.findall(r"\[([^\]]*)\]|\.?([A-Za-z_]\w*)", path):
        if isinstance(here, Many):
            here = Many(select(item, f".{field_}" if field_ else f"[{key}]", name) for item in here)
        elif field_ or isinstance(here, dict):
            k = field_ or key.strip()
            if not isinstance(here, dict) or k not in here:
                keys = ", ".join(list(here)[:12]) if isinstance(here, dict) else type(here).__name__
                raise MarkerError(f"{name}: no {k!r} in {path} (there: {keys})")
            here = here[k]
        elif isinstance(here, list):
            terms = [t.strip() for t in key.split(",") if t.strip()]

            def fits(item, term: str) -> bool:
                m = re.fullmatch(r"(\w+)\s*([*^]?=)\s*(.*)", term)
                if not isinstance(item, dict):
                    return False
                if m is None:
                    return any(str(x) == term for x in item.values() if not isinstance(x, (dict, list)))
                got, how, want = str(item.get(m[1])), m[2], m[3]
                return got == want if how == "=" else got.startswith(want) if how == "^=" else want in got
            hits = [item for item in here if all(fits(item, t) for t in terms)]
            if not hits:
                raise MarkerError(f"{name}: nothing in {path} matches [{key}]")
            here = hits[0] if len(hits) == 1 else Many(hits)
        else:
            raise MarkerError(f"{name}: {path} goes into a {type(here).__name__}")
    return here


def figure_value(data, expr: str, name: str) -> float:
    """Evaluate a figure's expression over JSON data: paths into the data, numbers, + - * / and
    min, max, sum, mean, abs. The paths are the names not followed by `(`."""
    values: dict[str, object] = {}

    def place(m: re.Match) -> str:
        if m.group(1) in FUNCTIONS and expr[m.end():].lstrip().startswith("("):
            return m.group(0)
        values[f"_v{len(values)}"] = select(data, m.group(0), name)
        return f"_v{len(values) - 1}"
    code = re.sub(r"(?<![\w.])([A-Za-z_]\w*)(?:\[[^\]]*\]|\.[A-Za-z_]\w*)*", place, expr)

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            value = values[node.id]
            if isinstance(value, Many):
                return value
            if type(value) not in (int, float):
                raise MarkerError(f"{name}: {expr} reads {value!r}, not a number")
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = number(ev(node.operand))
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](number(ev(node.left)), number(ev(node.right)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS \
                and not node.keywords:
            args = [ev(a) for a in node.args]
            return FUNCTIONS[node.func.id](*map(number, [v for a in args for v in (a if isinstance(a, Many) else [a])]))
        raise MarkerError(f"{name}: {expr}: only paths, numbers, + - * / and {', '.join(FUNCTIONS)}")

    def number(v) -> float:
        if isinstance(v, Many):
            raise MarkerError(f"{name}: {expr}: {len(v)} items selected where one number is meant")
        if type(v) not in (int, float):
            raise MarkerError(f"{name}: {expr} reads {v!r}, not a number")
        return v
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        raise MarkerError(f"{name}: cannot read {expr}: {e.msg}") from None
    return number(ev(tree))


def figure_errors(lines: list[str], tree: Path, rel: str) -> list[str]:
    """Every number a `<!-- fig: FILE EXPR[; EXPR...] -->` comment follows equals its expression over
    chapters/figures/FILE at the printed precision. A comment of n expressions covers the last n numbers
    before it on its line (after any comment before it on that line); `rows:` before the expressions, on
    a line of its own, covers each row of the table below it, `$1`, `$2`... standing for the row's cells."""
    errors, cache, code = [], {}, {i for start, end in fences(lines) for i in range(start, end + 1)}

    def load(name: str, where: str):
        if name not in cache:
            path = tree / FIGURES / name
            try:
                cache[name] = json.loads(path.read_text()) if path.is_file() else None
            except ValueError as e:
                raise MarkerError(f"{where}: {FIGURES}/{name} is not JSON: {e}") from None
        if cache[name] is None:
            raise MarkerError(f"{where}: no file {FIGURES}/{name}")
        return cache[name]

    def covered(text: str, exprs: list[str], file: str, where: str) -> None:
        numbers = NUMBER.findall(text)
        if len(numbers) < len(exprs):
            errors.append(f"{where}: {len(exprs)} expressions, but {len(numbers)} numbers before the comment")
            return
        data = load(file, where)
        for printed, expr in zip(numbers[len(numbers) - len(exprs):], exprs):
            value = figure_value(data, expr, where)
            if not agrees(printed, value):
                errors.append(f"{where}: {printed} is not {expr} = {value:.6g} ({file})")

    for i, line in enumerate(lines):
        if i in code or "<!--" not in line:
            continue
        start, where = 0, f"{rel}:{i + 1}"
        try:
            for m in re.finditer(r"<!--.*?-->", line):
                if m.group(0).startswith(("<!-- snippet:", "<!-- output")):
                    continue
                fig, quote = FIG.fullmatch(m.group(0)), QUOTE.fullmatch(m.group(0))
                if LOOKS_LIKE_CHECKED.match(m.group(0)) and not (fig or quote):
                    errors.append(f"{where}: not a figure or quote: `<!-- fig: FILE EXPR[; EXPR] -->`, "
                                  "`<!-- out: TEXT[; TEXT] -->`")
                if fig and fig["rows"]:
                    rows = [r for r in itertools.takewhile(lambda r: r.startswith("|"), lines[i + 1:])][2:]
                    if line.strip() != m.group(0) or not rows:
                        errors.append(f"{where}: a `rows:` figure stands alone on the line before a table")
                    for k, row in enumerate(rows):
                        cells = [c.strip() for c in row.strip().strip("|").split("|")]
                        exprs = re.sub(r"\$(\d+)", lambda c: cells[int(c.group(1)) - 1]
                                       if int(c.group(1)) <= len(cells) else c.group(0), fig["exprs"])
                        covered(row, [e.strip() for e in exprs.split(";")], fig["file"], f"{rel}:{i + k + 4}")
                elif fig:
                    covered(line[start:m.start()], [e.strip() for e in fig["exprs"].split(";")], fig["file"], where)
                start = m.end()
        except MarkerError as e:
            errors.append(str(e))
    return errors


def quote_errors(lines: list[str], rel: str) -> list[str]:
    """Every number a `<!-- out: TEXT[; TEXT...] -->` comment follows is, at its printed precision, the
    number at `~` in a line of the chapter's transcripts that TEXT matches (its spaces: any spaces)."""
    shown = [line for t in transcripts("\n".join(lines), rel)[0] for line in t.shown]
    code = {i for start, end in fences(lines) for i in range(start, end + 1)}
    errors = []
    for i, line in enumerate(lines):
        if i in code:
            continue
        start = 0
        for m in re.finditer(r"<!--.*?-->", line):
            quote, where = QUOTE.fullmatch(m.group(0)), f"{rel}:{i + 1}"
            if quote:
                texts = [t.strip() for t in quote["texts"].split(";")]
                numbers = NUMBER.findall(line[start:m.start()])[-len(texts):]
                if len(numbers) < len(texts) or any(t.count("~") != 1 for t in texts):
                    errors.append(f"{where}: a quote covers as many numbers before it as it has TEXTs, "
                                  "each with one `~` where the number is")
                    start = m.end()
                    continue
                for printed, text in zip(numbers, texts):
                    before, _, after = (re.sub(r"\s+", " ", p) for p in text.partition("~"))
                    pattern = re.compile(r" +".join(map(re.escape, before.split(" "))) + r" *"
                                         rf"({NUMERAL})"
                                         + r" *" + r" +".join(map(re.escape, after.split(" "))))
                    values = [m2.group(1) for s in shown for m2 in [pattern.search(s)] if m2]
                    if not values:
                        errors.append(f"{where}: no transcript line of this chapter reads `{text}`")
                    elif not any(agrees(printed, number_value(v)[0]) for v in values):
                        errors.append(f"{where}: {printed} is not what the transcript shows at `{text}`: "
                                      f"{', '.join(values)}")
            start = m.end()
    return errors


# ---------------------------------------------------------------- output

try:  # rich only colours the output; the text is the same without it
    from rich.console import Console
    from rich.text import Text
    _console: Console | None = Console(highlight=False, soft_wrap=True)
except ImportError:
    _console = None


def say(text: str, style: str | None = None) -> None:
    if _console is None:
        print(text, flush=True)
    else:
        _console.print(Text(text, style=style or ""))


class Report:
    """One line per check as it finishes, with its wall time (the time since the line before: checks
    run one after another); the total, then the closing line that counts them."""

    def __init__(self) -> None:
        self.passed = self.failed = 0
        self.start = self.last = time.monotonic()

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.passed, self.failed = self.passed + ok, self.failed + (not ok)
        now, summary = time.monotonic(), detail.partition("\n")[0] if ok else ""
        seconds, self.last = now - self.last, now
        say(f"{name:<32} {'pass' if ok else 'FAIL'} {seconds:7.1f} s  {summary}".rstrip(),
            "green" if ok else "bold red")
        if detail and not ok:
            say(textwrap.indent(detail, "    | "), "red")

    def close(self) -> int:
        print(f"total {time.monotonic() - self.start:.1f} s", flush=True)
        print(f"{self.passed} passed, {self.failed} failed", flush=True)
        return 1 if self.failed else 0


# ---------------------------------------------------------------- check

def cmd_check(root: Path, chapters: str | None, proofs: bool, timeout: float) -> int:
    report = Report()
    try:
        book = load_book(root)
    except MarkerError as e:
        report.add("markers", False, str(e))
        return report.close()
    count = sum(len(list(blocks(s.nodes))) for s in book.sources.values())
    report.add("markers", True, f"{len(book.sources)} files, {count} blocks")
    with tempfile.TemporaryDirectory(prefix="steps-check-") as tmp:
        stages: dict[int, Path] = {}
        for n in parse_chapters(chapters, book.registry.numbers):
            earlier = [c for c in book.registry.numbers if c < n]
            stages[n] = check_stage(book, n, Path(tmp), report, proofs, timeout,
                                    stages.get(earlier[-1]) if earlier else None)
        for rel, n in chapter_markdowns(book):
            if n in stages:
                errors, _ = check_markdown(book.root / rel, stages[n], rel, book, n)
                report.add(f"snippets ch{n:02d}", not errors, "\n".join(errors))
                errors = output_errors(book, rel, stages[n], timeout)
                if errors is not None:
                    report.add(f"outputs ch{n:02d}", not errors, "\n".join(errors))
    if (book.root / "tests" / "tools").is_dir():
        r = _run([sys.executable, "-m", "pytest", "tests/tools", "-q", "-p", "no:cacheprovider"], book.root)
        report.add("tools tests", r.returncode == 0, tail(r, 1 if r.returncode == 0 else 25))
    if (book.root / "practice" / "judge.py").is_file():
        r = _run([sys.executable, "practice/judge.py", "--root", str(book.root), "check"], book.root)
        report.add("judge", r.returncode == 0, tail(r, 1 if r.returncode == 0 else 25))
    return report.close()


def parse_chapters(spec: str | None, numbers: list[int]) -> list[int]:
    """'1-3,5' -> the registry's chapters among 1, 2, 3, 5 (all of them when spec is empty)."""
    wanted: set[int] = set()
    for part in (spec or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            wanted |= set(range(int(lo), int(hi or lo) + 1))
    return [n for n in numbers if not spec or n in wanted]


def check_stage(book: Book, n: int, tmp: Path, report: Report, proofs: bool, timeout: float,
                previous: Path | None = None) -> Path:
    """Build stage n, then check its imports, its cumulative tests, its example, its revert proofs.
    `previous`: the stage before, checked in this run; where n changes no code, only n's new tests run.
    The tests that run a program (an example, the command line) run in their own chapter's stage and in
    the last; the other stages leave out the earlier chapters' ones. The example and the proofs run side
    by side, one per core."""
    chapter, package = book.registry.chapter(n), book.registry.package
    stage = _build(book, n, tmp / f"ch{n:02d}")
    problems = package_error(stage, package) + stage_import_errors(stage, package, n)
    report.add(f"stage {n:02d} build", not problems, "\n".join(problems))
    targets = new_tests(stage, previous)
    last = n == max(book.registry.numbers)
    r = run_pytest(stage, ["tests"] if targets is None else targets, timeout=timeout * 4, parallel=True,
                   processes_from=0 if last else n)
    detail = "" if targets is None else f" (the code of stage {n - 1:02d}: only {', '.join(targets)})"
    report.add(f"stage {n:02d} tests", r.returncode == 0, (tail(r, 1, stderr=False) if r.returncode == 0 else tail(r)) + detail)
    broken, green = set(failed_tests(r)), r.returncode == 0  # a bug that only the broken catch proves nothing
    with ThreadPoolExecutor(WORKERS) as pool:  # one job per core, each pytest on one torch thread
        example = pool.submit(run_shown, stage, f"python {chapter.example}", timeout) \
            if chapter.example is not None else None
        fixes = [(f"proof {fix.name}", pool.submit(revert_proof, book, n, fix, stage, tmp, timeout, green))
                 for fix in (chapter.fixes if proofs else [])]
        fixes += [(f"proof {fix.name} at stage {n:02d}", pool.submit(revert_proof, book, n, fix, stage, tmp, timeout, green))
                  for fix in (chapter.rechecks if proofs else [])]  # an earlier fix, reverted here: caught here too
        bugs = [(f"bug {bug.name}", pool.submit(bug_proof, bug, stage, tmp, timeout * 4, broken))
                for bug in (chapter.bugs if proofs else [])]
        if example is None:
            report.add(f"stage {n:02d} example", False, "the registry names no example")
        else:
            r = example.result()
            report.add(f"stage {n:02d} example", r.returncode == 0, "" if r.returncode == 0 else tail(r))
        for name, problems in fixes:
            report.add(name, not problems.result(), "\n".join(problems.result()))
        for name, caught in bugs:
            report.add(name, *caught.result())
    return stage


def new_tests(stage: Path, previous: Path | None) -> list[str] | None:
    """Where a stage differs from the one before only in prose and in test modules, the test modules that
    are new or changed: the rest ran, on the same code, in the stage before. None (run every test) when
    there is no stage before in this run or any other file differs: code, conftest, an example."""
    if previous is None:
        return None

    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    before, after = files(previous), files(stage)
    changed = [rel for rel in sorted(before.keys() | after.keys()) if before.get(rel) != after.get(rel)]
    tests = [rel for rel in changed if rel in after and re.fullmatch(r"tests/test_[^/]+\.py", rel)]
    others = [rel for rel in changed if rel not in tests and not is_prose(rel)]
    return None if others or not tests else tests


def revert_proof(book: Book, n: int, fix: Fix, stage: Path, tmp: Path, timeout: float,
                 green: bool = False) -> list[str]:
    """Each listed test passes in the stage and FAILS with the fix reverted (pytest exit 1: the tests
    ran and broke; a reverted stage that cannot collect the test proves nothing). `green`: the stage's
    tests all passed just now, so they are not run again in it."""
    reverted = _build(book, n, tmp / f"ch{n:02d}-revert-{fix.name}", revert=fix.name)
    problems = []
    for test in fix.tests:
        good = subprocess.CompletedProcess([], 0) if green else run_pytest(stage, [test], timeout=timeout, one_thread=True)
        bad = run_pytest(reverted, [test], timeout=timeout, one_thread=True)
        if good.returncode != 0:
            problems.append(f"{test} does not pass with the fix in place:\n{tail(good, 10)}")
        if bad.returncode != 1:
            what = "passes" if bad.returncode == 0 else f"does not run (pytest exit {bad.returncode})"
            problems.append(f"{test} {what} with fix '{fix.name}' reverted: it does not catch the bug"
                            + f"\n{tail(bad, 10)}" * (bad.returncode != 0))
    return problems


def failed_tests(result: subprocess.CompletedProcess) -> list[str]:
    """The tests pytest's short summary names as FAILED or ERROR."""
    return [line.split(" - ")[0].split(" ", 1)[1] for line in (result.stdout or "").splitlines()
            if line.startswith(("FAILED ", "ERROR "))]


def bug_proof(bug: Bug, stage: Path, tmp: Path, timeout: float,
              broken: set[str] = frozenset()) -> tuple[bool, str]:
    """A copy of the stage with the bug planted fails its tests: pytest -x exits 1 (a test ran and
    failed), and the test that failed first is not one of the stage's `broken` tests (those that fail
    without the bug). Returns (caught, the test that caught it or what went wrong)."""
    planted = tmp / f"{stage.name}-bug-{bug.name}"
    shutil.copytree(stage, planted)
    path = planted / bug.file
    path.write_text(path.read_text().replace(bug.pattern, bug.replacement))
    r = run_pytest(planted, [*bug.tests, "-x"], timeout=timeout, one_thread=True)
    if r.returncode == 1:
        by = (failed_tests(r) or ["the tests"])[0]
        if by in broken:
            return False, f"bug {bug.name}: the first test to fail, {by}, fails without the bug too"
        return True, f"caught by {by}" + " (it timed out)" * ("Timeout (>" in r.stdout)
    if r.returncode == 0:
        return False, f"the tests do not catch bug {bug.name}: {', '.join(bug.tests)} pass with it planted"
    return False, (f"bug {bug.name}: the tests do not run with it planted (pytest exit {r.returncode})\n"
                   + tail(r, 10))


# ---------------------------------------------------------------- build, diff, tree, snippets

def two_stages(book: Book, n: int, tmp: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The files of the stage before n (none before the first chapter) and of stage n."""
    def read(stage: Path) -> dict[str, bytes]:
        return {p.relative_to(stage).as_posix(): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    earlier = [c for c in book.registry.numbers if c < n]
    before = read(_build(book, earlier[-1], tmp / "before")) if earlier else {}
    return before, read(_build(book, n, tmp / "after"))


def as_text(data: bytes | None) -> str | None:
    """A file's text ("" if absent), or None if it is binary."""
    try:
        return None if b"\0" in (data or b"") else (data or b"").decode()
    except UnicodeDecodeError:
        return None


def is_prose(rel: str) -> bool:
    """The chapters' text and registry, and any other prose: what `diff --code` leaves out."""
    return rel.startswith("chapters/") or rel.endswith(PROSE)


def say_diff(old: str, new: str, names: tuple[str, str], context: int = 3) -> None:
    styles = {"+++": "bold", "---": "bold", "+": "green", "-": "red", "@": "cyan"}
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), *names, lineterm="", n=context):
        say(line, styles.get(line[:3], styles.get(line[:1])))


def cmd_diff(book: Book, n: int, code: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="steps-diff-") as tmp:
        before, after = two_stages(book, n, Path(tmp))
    for rel in sorted(before.keys() | after.keys()):
        a, b = before.get(rel), after.get(rel)
        old, new = as_text(a), as_text(b)
        if a == b or (code and is_prose(rel)):
            continue
        if old is None or new is None:
            what = "added" if a is None else "removed" if b is None else "changed"
            say(f"binary file {what}: {rel}", "bold")
            continue
        say_diff(old, new, (f"a/{rel}" if a is not None else "/dev/null",
                            f"b/{rel}" if b is not None else "/dev/null"))
    return 0


def cmd_bugs(book: Book, n: int) -> int:
    """Chapter n's planted bugs, each as the unified diff of its change to stage n."""
    bugs = book.registry.chapter(n).bugs
    if not bugs:
        say(f"chapter {n:02d} plants no bugs")
    for bug in bugs:
        old = stage_text(book, bug.file, n)
        say(f"bug {bug.name}, caught by {', '.join(bug.tests)}", "bold")
        say_diff(old, old.replace(bug.pattern, bug.replacement), (f"a/{bug.file}", f"b/{bug.file}"), 1)
    return 0


def cmd_tree(book: Book, n: int) -> int:
    with tempfile.TemporaryDirectory(prefix="steps-tree-") as tmp:
        before, after = two_stages(book, n, Path(tmp))
    marks = {rel: "new" if rel not in before else "changed" if before[rel] != data else ""
             for rel, data in after.items()}
    counts = [sum(m == kind for m in marks.values()) for kind in ("new", "changed", "")]
    say(f"stage {n:02d} ({book.registry.chapter(n).slug}): {counts[0]} new, {counts[1]} changed, "
        f"{counts[2]} unchanged", "bold")
    print_tree(marks, "", 0)
    return 0


def print_tree(marks: dict[str, str], prefix: str, depth: int) -> None:
    """The files under `prefix` with their marks; a folder with nothing new or changed is one line."""
    here = {rel[len(prefix):]: m for rel, m in marks.items() if rel.startswith(prefix)}
    for folder in sorted({r.split("/")[0] for r in here if "/" in r}):
        inside = [m for r, m in here.items() if r.startswith(folder + "/")]
        if any(inside):
            say(f"{'  ' * depth}{folder}/")
            print_tree(marks, f"{prefix}{folder}/", depth + 1)
        else:
            say(f"{'  ' * depth}{folder}/ ({len(inside)} file{'s' * (len(inside) != 1)}, unchanged)", "dim")
    for name in sorted(r for r in here if "/" not in r):
        say(f"{'  ' * depth}{name:<{max(40 - 2 * depth, len(name) + 1)}} {here[name]}".rstrip(),
            {"new": "green", "changed": "yellow"}.get(here[name]))


def cmd_snippets(book: Book, write: bool) -> int:
    count, figures, wrong = 0, 0, 0
    with tempfile.TemporaryDirectory(prefix="steps-snippets-") as tmp:
        for rel, n in chapter_markdowns(book):
            stage, path = _build(book, n, Path(tmp) / f"ch{n:02d}"), book.root / rel
            errors, fixed = check_markdown(path, stage, rel, book, n)
            if write and fixed != path.read_text():
                path.write_text(fixed)
                say(f"rewrote {rel}", "yellow")
                errors, _ = check_markdown(path, stage, rel, book, n)
            count += sum(bool(SNIPPET.match(line)) for line in fixed.splitlines())
            figures += sum(len(FIG.findall(line)) + len(QUOTE.findall(line)) for line in fixed.splitlines())
            wrong += len(errors)
            for error in errors:
                say(error, "red")
    print(f"{count} snippets, {figures} figures and quotes, {wrong} wrong")
    return 1 if wrong else 0


def output_errors(book: Book, rel: str, stage: Path, timeout: float) -> list[str] | None:
    """`check`'s transcripts of one chapter: in its stage (the example's run reused) and in the final
    tree; None if the chapter has none."""
    md = book.root / rel
    if not transcripts(md.read_text(), rel)[0]:
        return None
    return (check_transcripts(md, stage, rel, final=False, timeout=timeout)
            + check_transcripts(md, book.root, rel, final=True, timeout=timeout))


def cmd_outputs(book: Book, chapters: str | None, timeout: float) -> int:
    """Every transcript of the chapters, run in the final tree (the book's root, as a reader runs it):
    no stage is built. `check` compares them in each chapter's stage too."""
    count, wrong = 0, 0
    wanted = set(parse_chapters(chapters, book.registry.numbers))
    for rel, n in chapter_markdowns(book):
        if n in wanted:
            errors = check_transcripts(book.root / rel, book.root, rel, final=True, timeout=timeout)
            count += len(transcripts((book.root / rel).read_text(), rel)[0])
            wrong += len(errors)
            for error in errors:
                say(error, "red")
    print(f"{count} transcripts, {wrong} wrong")
    return 1 if wrong else 0


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
