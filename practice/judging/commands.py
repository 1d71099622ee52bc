"""The learner's commands: `list`, `start`, `test` and `hint` (the author's `check` is check.py)."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

import steps  # tools/steps.py: importing judging put tools/ on the path

from . import JudgeError
from .console import _command, _plural, _rel, console
from .exercises import Exercise, find_exercise, load_exercises
from .failures import Failure, parse_failures, run_tests
from .hints import _print_hint, _show_next_hint
from .progress import load_progress, save_progress, status
from .workspace import lay_workspace, stub_line, workspace

MAX_DETAIL_LINES = 12      # of a failure's report; `test ID --verbose` shows pytest's whole output


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


def _location(stage: Path, rel: str, ex_id: str, root: Path) -> str:
    line = stub_line(stage, rel, ex_id)
    where = _rel(stage / rel, root)
    return f"{where}:{line}" if line else where
