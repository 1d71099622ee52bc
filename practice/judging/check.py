"""The author's `check`: the registry against the markers, then every stub fails its tests and every
reference passes them (nbgrader's check, both ways)."""

from __future__ import annotations

import fnmatch
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

import steps  # tools/steps.py: importing judging put tools/ on the path
from book.stages import Book  # tools/book/, beside it

from . import JudgeError
from .console import _plural, console
from .exercises import Exercise, load_exercises
from .failures import covers, parse_failures, run_tests
from .hints import giveaways
from .workspace import held_back, lay_workspace


@dataclass
class Verdict:
    """One exercise's result in `check`: what is wrong with it (nothing, once proved)."""
    ex: Exercise
    problems: list[str]


def cmd_check(root: Path, jobs: int, only: list[str] | None = None, passed: set[int] = frozenset()) -> int:
    """Structure first (registry against markers), then nbgrader's check both ways: every stub
    fails every test of its exercise, every reference passes them all. `only`: the exercises whose
    stubs and references run; the structure is checked for all. `passed`: chapters whose stage just
    ran every test of its own test files and passed (the step checker's run of the same tree): a
    reference's targets in those files are not run again (`own_tests`)."""
    exercises = load_exercises(root)
    if unknown := sorted(set(only or ()) - {ex.id for ex in exercises}):
        raise JudgeError(f"no exercise {', '.join(unknown)}; the exercises: {', '.join(ex.id for ex in exercises)}")
    verdicts = {ex.id: Verdict(ex, []) for ex in exercises}
    general = check_structure(root, exercises, verdicts)
    if only:     # the others' structural problems are still reported
        verdicts = {ex_id: v for ex_id, v in verdicts.items() if ex_id in only or v.problems}
    with tempfile.TemporaryDirectory(prefix="judge-check-") as tmp:
        todo = [v for v in verdicts.values() if not v.problems]
        book = steps.load_book(root) if todo else None   # the markers parse: no verdict says otherwise
        references = build_references(book, todo, Path(tmp))
        check_test_files(todo, references)
        todo = [v for v in todo if not v.problems]
        stubs = build_stubs(root, book, todo, Path(tmp))
        chapters = sorted({v.ex.chapter for v in todo})
        alone = {v.ex.id: lay_workspace(root, v.ex, Path(tmp) / f"answer-{v.ex.id}", answer=True, book=book)
                 for v in todo if held_back(book, v.ex)}   # its reference beside the later ones' stubs
        if jobs > 1:     # runs side by side: one thread each, or torch's threads oversubscribe the cores
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:  # the pytest runs, side by side
            stub_runs = {ex_id: pool.submit(prove_stub, verdicts[ex_id].ex, stub)
                         for ex_id, stub in stubs.items()}
            ref_runs = [pool.submit(prove_references, [v.ex for v in todo if v.ex.chapter == chapter
                                                       and v.ex.id not in alone], references[chapter],
                                    own_tests(chapter) if chapter in passed else ())
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


def build_references(book: Book | None, verdicts: list[Verdict], tmp: Path) -> dict[int, Path]:
    """Each chapter's reference stage, built once for all its exercises, from the source parsed once."""
    stages: dict[int, Path] = {}
    for chapter in sorted({v.ex.chapter for v in verdicts}):
        try:
            stages[chapter] = steps._build(book, chapter, tmp / f"ch{chapter:02d}")
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


def build_stubs(root: Path, book: Book | None, verdicts: list[Verdict], tmp: Path) -> dict[str, Path]:
    stubs: dict[str, Path] = {}
    for verdict in verdicts:
        ex = verdict.ex
        try:
            stubs[ex.id] = lay_workspace(root, ex, tmp / f"stub-{ex.id}", book=book)
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


def own_tests(chapter: int) -> str:
    """The pattern of a chapter's own test files in tests/: test_ch17_*.py for chapter 17."""
    return f"tests/test_ch{chapter:02d}_*.py"


def prove_references(exercises: list[Exercise], reference: Path, ran: str = "") -> dict[str, list[str]]:
    """All tests pass on the reference: one run for the chapter, one per exercise only if it fails.
    `ran`: a pattern of test files that passed on this very tree just now; their targets are left out."""
    def left(tests: list[str]) -> list[str]:
        return [t for t in tests if not (ran and fnmatch.fnmatchcase(t.split("::")[0], ran))]
    tests = left(list(dict.fromkeys(test for ex in exercises for test in ex.tests)))
    if not tests or run_tests(reference, tests)[0] == 0:
        return {}
    problems: dict[str, list[str]] = {}
    for ex in exercises:
        if not (targets := left(ex.tests)):
            continue
        code, output = run_tests(reference, targets)
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
