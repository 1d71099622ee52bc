"""`check`: every stage built, its imports, its tests and its example; the revert proofs and the planted
bugs; the chapters' snippets, figures, quotes and transcripts; the tools' own tests; the judge.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .chapters import chapter_markdowns, check_markdown
from .markers import MarkerError, blocks
from .proofs import bug_proof, failed_tests, revert_proof
from .registry import parse_chapters
from .report import Report
from .running import WORKERS, _run, package_error, run_pytest, stage_import_errors, tail
from .stages import Book, _build, is_prose, load_book
from .transcripts import output_errors, run_shown


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
        shown = [(rel, n) for rel, n in chapter_markdowns(book) if n in stages]
        with ThreadPoolExecutor(WORKERS) as pool:  # the transcripts' commands, one per core
            outputs = [pool.submit(output_errors, book, rel, stages[n], timeout) for rel, n in shown]
            for (rel, n), output in zip(shown, outputs):
                errors, _ = check_markdown(book.root / rel, stages[n], rel, book, n)
                report.add(f"snippets ch{n:02d}", not errors, "\n".join(errors))
                if (errors := output.result()) is not None:
                    report.add(f"outputs ch{n:02d}", not errors, "\n".join(errors))
    if (book.root / "tests" / "tools").is_dir():
        spread = ["-n", str(WORKERS)] if importlib.util.find_spec("xdist") else []   # one torch thread per worker
        r = _run([sys.executable, "-m", "pytest", "tests/tools", "-q", "-p", "no:cacheprovider", *spread], book.root,
                 {**os.environ, "OMP_NUM_THREADS": "1"})
        report.add("tools tests", r.returncode == 0, tail(r, 1 if r.returncode == 0 else 25))
    if (book.root / "practice" / "judge.py").is_file():   # a reference's targets that its stage just passed: not again
        green = ",".join(str(n) for n in stages if f"stage {n:02d} tests" in report.ok)
        r = _run([sys.executable, "practice/judge.py", "--root", str(book.root), "check", "--stage-tests-passed", green],
                 book.root)
        report.add("judge", r.returncode == 0, tail(r, 1 if r.returncode == 0 else 25))
    return report.close()


# A stage's whole run may take this many times a run's timeout: the last stage runs every test, 24 minutes on
# a slow day of two cores (20 minutes, the limit before, cut it short there); a hang is the per-test timeout's.
STAGE_RUNS = 12


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
    r = run_pytest(stage, ["tests"] if targets is None else targets, timeout=timeout * STAGE_RUNS, parallel=True,
                   earlier_from=0 if last else n)
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
