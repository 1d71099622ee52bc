"""The exercise judge: stubs from the reference, tests, hints and progress (rustlings + nbgrader).

An exercise is a solution region in the source, between `# >>> exercise NN.K: title` and
`# <<< exercise NN.K` (tools/README.md has the marker grammar), listed in practice/exercises.toml
with the tests that must pass and the hints to give:

    python practice/judge.py list              # every exercise, in order, with your progress
    python practice/judge.py start 01.1        # chapter 01's tree, stubbed, in practice/workspace/01.1/
    python practice/judge.py test 01.1         # run its tests there: what failed, then a hint
    python practice/judge.py test 01.1 --verbose   # ... with pytest's whole output
    python practice/judge.py hint 01.1         # the next hint, for the test that failed last
    python practice/judge.py hint 01.1 --solution  # the last hint, which is the solution (--all: every hint)
    python practice/judge.py check             # the author's (CI): stubs fail, references pass

Stages are built by tools/steps.py; `--root DIR` points every command at another book (the tools'
own tests use a small fixture book). Progress lives in ROOT/practice/workspace/progress.json.

A hint is a string, or a table `{ text = "...", when = "..." }` (`when` may be a list of strings): a
hint with `when` belongs to a failure whose test's node id or error text (its message, the failing
line, the error's lines) contains one of them, and is given first for it, the first failure's first.
The last hint of an exercise is its solution: `hint` and `test` never give it; `hint ID --solution`
(or `--all`) does, and `check` refuses a hint before it that holds a piece of the reference's code.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import sys
import tempfile
import textwrap
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import steps  # noqa: E402  (tools/ is not a package)

console = Console(soft_wrap=True, highlight=False)
ID_PATTERN = re.compile(r"\d{2}\.\d+")
SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt|Warning)\b")
FILE_LINE = re.compile(r'^File "(.+)", line (\d+)')
# `____ test_x ____`: pytest centres a head in underscores, as few as one each side for a long name
# (`_ test_a_long_name[case] _`); a traceback's `_ _ _ _` between frames is no head
SECTION_HEAD = re.compile(r"^_+ (?:ERROR (?:collecting|at \w+ of) )?([^_ ].*?) _+$")
LOCATION_LINE = re.compile(r"^(\S+\.py):(\d+): \w+$")     # `tests/test_x.py:89: AssertionError`
MAX_DETAIL_LINES = 12      # of a failure's report; `test ID --verbose` shows pytest's whole output


class JudgeError(Exception):
    """A usage error: an unknown exercise, a workspace that is missing or already there."""


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


@dataclass(frozen=True)
class Failure:
    node: str      # a pytest node id, or a file for a collection error
    message: str   # the assertion or exception line
    details: tuple[str, ...] = ()   # where it failed, the failing line, then the first lines of the error

    @property
    def error(self) -> str:
        """Everything the failure says besides its name: what a hint's `when` is also matched against."""
        return "\n".join([self.message, *self.details]).strip()


# ---------------------------------------------------------------- the registry and progress


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


def workspace(root: Path) -> Path:
    return root / "practice" / "workspace"


def load_progress(root: Path) -> dict[str, dict]:
    """{id: {"status": "started" | "passed", "hints_seen": [index, ...],
    "last_failed": [{"node": node id, "error": what it said}, ...]}}; empty before the first start."""
    path = workspace(root) / "progress.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save_progress(root: Path, progress: dict[str, dict]) -> None:
    ws = workspace(root)
    ws.mkdir(parents=True, exist_ok=True)
    ignore = ws / ".gitignore"  # the learner's work stays out of the book's history
    if not ignore.exists():
        ignore.write_text("*\n")
    (ws / "progress.json").write_text(json.dumps(progress, indent=2, sort_keys=True) + "\n")


def status(root: Path, progress: dict[str, dict], ex: Exercise) -> str:
    stored = progress.get(ex.id, {}).get("status")
    if stored == "passed":
        return "passed"
    return "started" if stored or (workspace(root) / ex.id).is_dir() else "not started"


# ---------------------------------------------------------------- pytest output


def run_tests(stage: Path, targets: list[str]) -> tuple[int, str]:
    """Run the targets in the stage; (exit code, stdout + stderr)."""
    result = steps.run_pytest(stage, targets, quiet=True)
    return result.returncode, (result.stdout or "") + (result.stderr or "")


def parse_failures(output: str) -> list[Failure]:
    """Failed and errored tests from pytest's short summary, each with its exception line and the
    first lines of its traceback's end (the summary's line is trimmed to the terminal's width)."""
    sections = _sections(output)
    failures = []
    for line in output.splitlines():
        match = SUMMARY_LINE.match(line.strip())
        if match and ("::" in match[2] or match[2].endswith(".py")):
            node, summary = match[2], match[3] or ""
            lines = sections.get(_head_of(node), [])
            errors = [line[1:].strip() for line in lines if line.startswith("E ")]
            message = _exception_line(errors) if errors else summary
            failures.append(Failure(node, message, _details(lines)))
    return failures


def _sections(output: str) -> dict[str, list[str]]:
    """{section head: its lines} of pytest's failure and error reports."""
    sections: dict[str, list[str]] = {}
    head = None
    for line in output.splitlines():
        if (match := SECTION_HEAD.match(line)):
            head = match[1]
            sections.setdefault(head, [])
        elif re.match(r"^(=|-){3,} .* (=|-){3,}$", line):   # `=== short test summary info ===`, `--- Captured ...`
            head = None
        elif head:
            sections[head].append(line)
    return sections


def _details(lines: list[str]) -> tuple[str, ...]:
    """Where a test failed (`file:line`), the line that failed (`> ...`), then the error's own lines:
    the assertion with its values, or the message, whole (pytest's `E` lines), without the blanks."""
    first_error = next((i for i, line in enumerate(lines) if line.startswith("E ")), None)
    if first_error is None:
        return ()
    failing = next((line for line in reversed(lines[:first_error]) if line.startswith(">")), None)
    where = next((m for line in lines[first_error:] if (m := LOCATION_LINE.match(line))), None)
    errors = "\n".join(line[1:] for line in lines[first_error:] if line.startswith("E "))
    errors = textwrap.dedent(errors).splitlines()
    errors = [line.rstrip() for line in errors if line.strip() and line.strip() != "Use -v to get more diff"]
    head = [f"{where[1]}:{where[2]}"] if where else []
    if failing and failing[1:].strip():
        head.append("> " + failing[1:].strip())
    return (*head, *errors)


def _exception_line(lines: list[str]) -> str:
    """`AssertionError: assert 1 == 2`, with the file and line for a SyntaxError and the like."""
    found = next((line for line in lines if EXCEPTION_LINE.match(line)), lines[0])
    where = next((m for line in lines if (m := FILE_LINE.match(line))), None)
    return f"{found} ({where[1]}:{where[2]})" if where and found != where[0] else found


def _head_of(node: str) -> str:
    """The section head pytest prints for a node: `test_x`, `Class.test_x`, or the file."""
    path, _, rest = node.partition("::")
    return rest.replace("::", ".") if rest else path


def covers(node: str, target: str) -> bool:
    """Whether a reported node (a test, one of its parametrized cases, or a file that failed to
    collect) belongs to a target."""
    return (node == target or node.startswith((target + "::", target + "["))
            or target.startswith(node + "::"))


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


# ---------------------------------------------------------------- list, start, test, hint


def cmd_list(root: Path) -> int:
    exercises = load_exercises(root)
    progress = load_progress(root)
    files = marker_files(root)
    table = Table(title="Exercises", title_justify="left")
    for column in ("id", "title", "chapter", "file to edit", "progress"):
        table.add_column(column, no_wrap=column != "title")   # only a title may wrap, never a path
    colours = {"passed": "green", "started": "yellow", "not started": "dim"}
    for ex in exercises:
        state = status(root, progress, ex)
        table.add_row(ex.id, escape(ex.title), f"{ex.chapter:02d}", escape(files.get(ex.id, "?")),
                      f"[{colours[state]}]{state}[/]")
    # Rich fits a table to the console, cutting what does not fit, and when stdout is not a terminal
    # (a pipe, a file) it assumes 80 columns. A terminal wide enough for the table with its titles
    # wrapped gets it so; a pipe, a file or a narrower terminal gets it whole, one line per exercise.
    size = Measurement.get(console, console.options.update_width(10_000), table)
    fits = console.is_terminal and console.width >= size.minimum
    (console if fits else Console(soft_wrap=True, highlight=False, width=size.maximum)).print(table)
    passed = sum(status(root, progress, ex) == "passed" for ex in exercises)
    done = round(30 * passed / max(len(exercises), 1))
    console.print(f"[green]{'█' * done}[/][dim]{'░' * (30 - done)}[/] {passed}/{len(exercises)} passed")
    return 0


def marker_files(root: Path) -> dict[str, str]:
    """{exercise id: the source file it lives in}; empty when the markers do not parse."""
    try:
        return {ex_id: str(marker.path) for ex_id, marker in steps.find_exercises(root).items()}
    except steps.MarkerError:
        return {}


def cmd_start(root: Path, ex_id: str, force: bool) -> int:
    ex = find_exercise(load_exercises(root), ex_id)
    marker = steps.find_exercises(root).get(ex.id)
    if marker is None:
        raise JudgeError(f"exercise '{ex.id}' has no `# >>> exercise {ex.id}` marker in the source")
    dest = workspace(root) / ex.id
    if dest.exists() and not force:
        raise JudgeError(f"{_rel(dest, root)} already exists and holds your work on exercise {ex.id}; "
                         f"`start {ex.id} --force` replaces it with a fresh stub")
    stage = lay_workspace(root, ex, dest)
    progress = load_progress(root)
    progress.setdefault(ex.id, {})["status"] = "started"
    save_progress(root, progress)
    console.print(f"[bold]exercise {ex.id}[/]: {escape(ex.title)} (chapter {ex.chapter:02d})")
    console.print(f"edit  {escape(_location(stage, str(marker.path), ex.id, root))}")
    console.print(f"test  {escape(_command(root, 'test', ex.id))}   (runs {escape(', '.join(ex.tests))})")
    console.print(f"hint  {escape(_command(root, 'hint', ex.id))}")
    return 0


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


def cmd_test(root: Path, ex_id: str, whole_stage: bool = False, verbose: bool = False) -> int:
    exercises = load_exercises(root)
    ex = find_exercise(exercises, ex_id)
    stage = workspace(root) / ex.id
    if not stage.is_dir():
        raise JudgeError(f"exercise {ex.id} is not started: run `{_command(root, 'start', ex.id)}` first")
    targets = ["tests", *(t for t in ex.tests if not t.startswith("tests/"))] if whole_stage else ex.tests
    code, output = run_tests(stage, [*targets, "-vv"] if verbose else targets)
    if verbose:
        console.out(output.rstrip(), highlight=False)
    progress = load_progress(root)
    entry = progress.setdefault(ex.id, {})
    if code == 0:
        entry["status"] = "passed"
        entry.pop("last_failed", None)
        save_progress(root, progress)
        _congratulate(root, exercises, ex, progress)
        return 0
    if f"NotImplementedError: exercise {ex.id}:" in output:
        marker = steps.find_exercises(root).get(ex.id)
        where = _location(stage, str(marker.path), ex.id, root) if marker else _rel(stage, root)
        console.print(f"[yellow]exercise {ex.id} is not implemented yet: edit {escape(where)}[/]")
        console.print(f"a hint: `{escape(_command(root, 'hint', ex.id))}`")
        return 1
    failures = _report_failures(root, stage, ex, code, output, verbose)
    entry["last_failed"] = [{"node": failure.node, "error": failure.error} for failure in failures]
    save_progress(root, progress)
    _show_next_hint(root, ex, progress)
    return 1


def _report_failures(root: Path, stage: Path, ex: Exercise, code: int, output: str,
                     verbose: bool) -> list[Failure]:
    """What failed: each test with where it failed (a path you can open), the failing line and the
    error's first lines."""
    failures = parse_failures(output)
    if not failures:  # a usage error, no test collected, a crash: show what pytest said
        console.print(f"[red]exercise {ex.id}: pytest exited with {code}:[/]")
        if not verbose:
            console.print(escape("\n".join(output.strip().splitlines()[-15:])), markup=True)
        return failures
    console.print(f"[red]exercise {ex.id}: {_plural(len(failures), 'test')} failed[/]")
    for failure in failures:
        console.print(f"  [red]✘[/] {escape(failure.node)}")
        lines = list(failure.details) or [failure.message] * bool(failure.message)
        if lines and (where := re.fullmatch(r"(\S+\.py):(\d+)", lines[0])) and (stage / where[1]).is_file():
            lines[0] = f"{_rel(stage / where[1], root)}:{where[2]}"
        for line in lines[:MAX_DETAIL_LINES]:
            console.print(f"      {escape(line)}")
        if len(lines) > MAX_DETAIL_LINES and not verbose:
            console.print(f"      [dim]... {_plural(len(lines) - MAX_DETAIL_LINES, 'more line')}: "
                          f"`{escape(_command(root, 'test', ex.id))} --verbose` shows pytest's whole output[/]")
    return failures


def _congratulate(root: Path, exercises: list[Exercise], ex: Exercise, progress: dict) -> None:
    console.print(f"[green]✔ exercise {ex.id} passed[/]: {escape(ex.title)} "
                  f"({_plural(len(ex.tests), 'test target')} pass)")
    later = [e for e in exercises if e.order > ex.order] + [e for e in exercises if e.order < ex.order]
    todo = [e for e in later if status(root, progress, e) != "passed"]
    if todo:
        verb = "start" if status(root, progress, todo[0]) == "not started" else "test"
        console.print(f"next: {todo[0].id} {escape(todo[0].title)}: "
                      f"`{escape(_command(root, verb, todo[0].id))}`")
    else:
        console.print(f"that was the last one: all {len(exercises)} exercises passed")


def cmd_hint(root: Path, ex_id: str, show_all: bool = False, solution: bool = False) -> int:
    ex = find_exercise(load_exercises(root), ex_id)
    if not ex.hints:
        console.print(f"exercise {ex.id} has no hints")
        return 0
    if show_all:
        for index in range(len(ex.clues)):
            _print_hint(ex, index)
    if show_all or solution:
        console.print(f"[magenta]solution[/] for {ex.id}: {escape(ex.solution.text)}")
        return 0
    _show_next_hint(root, ex, load_progress(root))
    return 0


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


def _location(stage: Path, rel: str, ex_id: str, root: Path) -> str:
    line = stub_line(stage, rel, ex_id)
    where = _rel(stage / rel, root)
    return f"{where}:{line}" if line else where


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


# ---------------------------------------------------------------- check (the author's)


@dataclass
class Verdict:
    """One exercise's result in `check`: what is wrong with it (nothing, once proved)."""
    ex: Exercise
    problems: list[str]


def cmd_check(root: Path, jobs: int, only: list[str] | None = None) -> int:
    """Structure first (registry against markers), then nbgrader's check both ways: every stub
    fails every test of its exercise, every reference passes them all. `only`: the exercises whose
    stubs and references run; the structure is checked for all."""
    exercises = load_exercises(root)
    if unknown := sorted(set(only or ()) - {ex.id for ex in exercises}):
        raise JudgeError(f"no exercise {', '.join(unknown)}; the exercises: {', '.join(ex.id for ex in exercises)}")
    verdicts = {ex.id: Verdict(ex, []) for ex in exercises}
    general = check_structure(root, exercises, verdicts)
    if only:     # the others' structural problems are still reported
        verdicts = {ex_id: v for ex_id, v in verdicts.items() if ex_id in only or v.problems}
    with tempfile.TemporaryDirectory(prefix="judge-check-") as tmp:
        todo = [v for v in verdicts.values() if not v.problems]
        references = build_references(root, todo, Path(tmp))
        check_test_files(todo, references)
        todo = [v for v in todo if not v.problems]
        stubs = build_stubs(root, todo, Path(tmp))
        chapters = sorted({v.ex.chapter for v in todo})
        alone = {v.ex.id: lay_workspace(root, v.ex, Path(tmp) / f"answer-{v.ex.id}", answer=True)
                 for v in todo if held_back(root, v.ex)}   # its reference beside the later ones' stubs
        if jobs > 1:     # runs side by side: one thread each, or torch's threads oversubscribe the cores
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:  # the pytest runs, side by side
            stub_runs = {ex_id: pool.submit(prove_stub, verdicts[ex_id].ex, stub)
                         for ex_id, stub in stubs.items()}
            ref_runs = [pool.submit(prove_references, [v.ex for v in todo if v.ex.chapter == chapter
                                                       and v.ex.id not in alone], references[chapter])
                        for chapter in chapters]
            ref_runs += [pool.submit(prove_references, [verdicts[ex_id].ex], stage)
                         for ex_id, stage in alone.items()]
            for ex_id, run in stub_runs.items():
                verdicts[ex_id].problems += run.result()
            for run in ref_runs:
                for ex_id, problems in run.result().items():
                    verdicts[ex_id].problems += problems
    return report(list(verdicts.values()), general)


def check_structure(root: Path, exercises: list[Exercise], verdicts: dict[str, Verdict]) -> list[str]:
    """Registry against markers and chapters; returns the problems that belong to no registry entry."""
    try:
        markers = steps.find_exercises(root)
        chapters = {chapter.number for chapter in steps.load_registry(root).chapters}
        code = reference_code(root)
    except steps.MarkerError as error:
        for verdict in verdicts.values():
            verdict.problems.append("not checked: the source's markers have errors")
        return [f"markers: {error}"]
    for ex in exercises:
        marker, problems = markers.get(ex.id), verdicts[ex.id].problems
        if marker is None:
            problems.append(f"no `# >>> exercise {ex.id}: ...` marker in the source")
        elif marker.title != ex.title:
            problems.append(f"the marker at {marker.path}:{marker.line} says '{marker.title}', "
                            f"the registry '{ex.title}'")
        if ex.chapter not in chapters:
            problems.append(f"chapter {ex.chapter:02d} is not in chapters/chapters.toml")
        if not ex.tests:
            problems.append("lists no tests")
        if not ex.hints:
            problems.append("has no hints")
        for number, hint in enumerate(ex.clues, 1):
            if (pieces := giveaways(hint.text, code.get(ex.id, []))):
                problems.append(f"hint {number} gives the solution away: it holds the reference's "
                                f"{' and '.join(f'`{piece}`' for piece in pieces)} (only the last hint may)")
        if ex.solution and ex.solution.when:
            problems.append("the last hint is the solution, which no failure gives: it takes no `when`")
    return [f"marker `# >>> exercise {m.id}` at {m.path}:{m.line} has no entry in practice/exercises.toml"
            for m in markers.values() if m.id not in verdicts]


def reference_code(root: Path) -> dict[str, list[str]]:
    """{exercise id: the lines of its solution region as its chapter's stage holds them}."""
    book = steps.load_book(root)
    return {b.exercise: steps.render(b.body, int(b.exercise.split(".")[0]), None, None, set())
            for source in book.sources.values() for b in steps.blocks(source.nodes) if b.exercise}


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


def build_references(root: Path, verdicts: list[Verdict], tmp: Path) -> dict[int, Path]:
    """Each chapter's reference stage, built once for all its exercises."""
    stages: dict[int, Path] = {}
    for chapter in sorted({v.ex.chapter for v in verdicts}):
        try:
            stages[chapter] = steps.build_stage(root, chapter, tmp / f"ch{chapter:02d}")
        except steps.MarkerError as error:
            for verdict in verdicts:
                if verdict.ex.chapter == chapter:
                    verdict.problems.append(f"stage {chapter:02d} does not build: {error}")
    return stages


def check_test_files(verdicts: list[Verdict], references: dict[int, Path]) -> None:
    """Every listed test file is in the exercise's stage."""
    for verdict in verdicts:
        stage = references.get(verdict.ex.chapter)
        for test in verdict.ex.tests if stage else []:
            path = test.split("::")[0]
            if not (stage / path).is_file():
                verdict.problems.append(f"test file {path} is not in stage {verdict.ex.chapter:02d}")


def build_stubs(root: Path, verdicts: list[Verdict], tmp: Path) -> dict[str, Path]:
    stubs: dict[str, Path] = {}
    for verdict in verdicts:
        ex = verdict.ex
        try:
            stubs[ex.id] = lay_workspace(root, ex, tmp / f"stub-{ex.id}")
        except steps.MarkerError as error:
            verdict.problems.append(f"the stub does not build: {error}")
    return stubs


def prove_stub(ex: Exercise, stub: Path) -> list[str]:
    """Every test must fail on the stub: one that passes cannot catch a missing solution. A hint's
    `when` that is part of no test's name is an error's text: the stub's failures must show it (as
    07.1's stub, chapter 06's code, shows `x not in list`), or the hint could be a typo never given."""
    code, output = run_tests(stub, [*ex.tests, "-rA"])  # -rA: PASSED lines in the summary too
    if code not in (0, 1, 2):
        return [f"pytest could not run the tests on the stub (exit {code}): {_last_line(output)}"]
    failures = parse_failures(output)
    passed = [line.split()[1] for line in output.splitlines() if line.startswith("PASSED ")]
    problems = []
    for test in ex.tests:
        passes = [node for node in passed if covers(node, test)]
        problems += [f"the stub passes {node}: it cannot catch a missing solution" for node in passes]
        if not passes and not any(covers(failure.node, test) for failure in failures):
            problems.append(f"{test} does not fail on the stub (skipped?)")
    for number, hint in enumerate(ex.clues, 1):
        for when in hint.when:
            if when not in hint.names(ex.tests) and not any(when in failure.error for failure in failures):
                problems.append(f"hint {number}: when = '{when}' is in none of its tests' names, nor in "
                                f"what they say when they fail on the stub")
    return problems


def prove_references(exercises: list[Exercise], reference: Path) -> dict[str, list[str]]:
    """All tests pass on the reference: one run for the chapter, one per exercise only if it fails."""
    tests = list(dict.fromkeys(test for ex in exercises for test in ex.tests))
    if not tests or run_tests(reference, tests)[0] == 0:
        return {}
    problems: dict[str, list[str]] = {}
    for ex in exercises:
        code, output = run_tests(reference, ex.tests)
        if code != 0:
            failed = [f"{f.node} ({f.message})" if f.message else f.node for f in parse_failures(output)]
            what = "; ".join(failed) or f"pytest exited {code}: {_last_line(output)}"
            problems[ex.id] = [f"the reference fails: {what}"]
    return problems


def _last_line(output: str) -> str:
    lines = output.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def report(verdicts: list[Verdict], general: list[str]) -> int:
    """One line per exercise (and per problem of no exercise), then `N passed, N failed`."""
    for problem in general:
        console.print(f"[red]✘[/] {escape(problem)}")
    for verdict in verdicts:
        ex = verdict.ex
        head = f"{ex.id} {escape(ex.title)}"
        if verdict.problems:
            console.print(f"[red]✘ {head}[/]: {escape('; '.join(verdict.problems))}")
        else:
            console.print(f"[green]✔ {head}[/]: the stub fails and the reference passes "
                          f"{_plural(len(ex.tests), 'test target')}")
    failed = sum(bool(v.problems) for v in verdicts) + len(general)
    print(f"{len(verdicts) + len(general) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="the book's root (default: the repository holding this file)")
    main = argparse.ArgumentParser(prog="judge.py", description=__doc__.split("\n")[0],
                                   parents=[common])
    commands = main.add_subparsers(dest="command", required=True)
    commands.add_parser("list", parents=[common], help="every exercise and your progress")
    start = commands.add_parser("start", parents=[common], help="lay the stub in practice/workspace/ID/")
    start.add_argument("id")
    start.add_argument("--force", action="store_true", help="replace an existing workspace (your work!)")
    test = commands.add_parser("test", parents=[common], help="run the exercise's tests in its workspace")
    test.add_argument("id")
    test.add_argument("--chapter", action="store_true", dest="whole_stage",
                      help="also every other test of the chapter's stage")
    test.add_argument("--verbose", "-v", action="store_true", help="also pytest's whole output")
    hint = commands.add_parser("hint", parents=[common],
                               help="the next hint (for the tests that failed last); never the solution")
    hint.add_argument("id")
    reveal = hint.add_mutually_exclusive_group()
    reveal.add_argument("--solution", action="store_true", help="the last hint: the solution")
    reveal.add_argument("--all", action="store_true", dest="show_all", help="every hint, the solution last")
    check = commands.add_parser("check", parents=[common],
                                help="the author's check: stubs fail, references pass")
    check.add_argument("ids", nargs="*", metavar="ID", help="only these exercises' stubs and references")
    check.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="pytest runs at once")
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path(getattr(args, "root", REPO)).resolve()
    try:
        if args.command == "list":
            return cmd_list(root)
        if args.command == "start":
            return cmd_start(root, args.id, args.force)
        if args.command == "test":
            return cmd_test(root, args.id, args.whole_stage, args.verbose)
        if args.command == "hint":
            return cmd_hint(root, args.id, args.show_all, args.solution)
        return cmd_check(root, args.jobs, args.ids)
    except (JudgeError, steps.MarkerError, OSError) as error:
        Console(stderr=True, soft_wrap=True, highlight=False).print(f"[red]error:[/] {escape(str(error))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
