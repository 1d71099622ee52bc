"""The marker grammar and its parser, and the rules that keep the source readable (tools/README.md:
"Markers in Python source", "Rules that keep the source readable").

parse_source turns one file into a tree of lines and blocks; layout_errors holds a file to the rules.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

MARKER = re.compile(r"^(?P<indent>[ \t]*)# (?P<dir>>>>|<<<) (?P<body>.*?)\s*$")
LOOKS_LIKE_MARKER = re.compile(r"^[ \t]*#\s*(>>>|<<<)")
OLD_LINE = re.compile(r"^[ \t]*#\|(?P<rest>.*)$")
OPEN_CH = re.compile(r"ch(?P<ch>\d+)(?: fix (?P<fix>[\w.-]+))?(?: (?P<kind>replaces|removes) ch(?P<old>\d+))?"
                     r":(?: (?P<text>.*))?$")
OPEN_FILE = re.compile(r"ch(?P<ch>\d+) file:(?: .*)?$")
OPEN_EXERCISE = re.compile(r"exercise (?P<id>(?P<ch>\d+)\.\d+)(?: from ch(?P<start>\d+))?: (?P<title>\S.*)$")
CLOSE = re.compile(r"ch(?P<ch>\d+)$|exercise (?P<id>\d+\.\d+)$")


class MarkerError(ValueError):
    """A structural error (markers, registry, stage); each message starts `file:line:`."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or [message]


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
