"""The proofs that the tests catch bugs: a fix reverted in its stage (or a later one, a recheck) makes
its regression tests fail; a planted bug makes the chapter's tests fail.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .registry import Bug, Fix
from .running import run_pytest, tail
from .stages import Book, _build


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
