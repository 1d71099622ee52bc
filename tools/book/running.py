"""Running things in a stage: pytest, hermetic and under a per-test timeout, and any command; and the
checks of a built stage, that its package and every import of its own modules resolve inside it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import warm as warm_runs
from .stages import SKIP_DIRS

TEST_TIMEOUT = 300  # seconds per test in a stage, as [tool.pytest.ini_options] timeout in pyproject.toml
WORKERS = 2  # pytest-xdist workers for a stage's tests (the CI machine has 2 cores)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a command, stdin closed, and capture its output; a timeout comes back as exit status 124."""
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f}s\n")


def run_python(argv: list[str], cwd: Path, env: dict[str, str], timeout: float | None = None,
               warm: bool = True) -> subprocess.CompletedProcess:
    """`python ARGV`: in a child of the warm fork server where it can (tools/book/warm.py), else fresh."""
    if warm and warm_runs.available():
        return warm_runs.run_warm(argv, cwd, env, timeout)
    return _run([sys.executable, *argv], cwd, env, timeout)


def stage_env(stage: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(stage), "PYTHONDONTWRITEBYTECODE": "1"}


MARKS = ("process: runs a program in a process of its own (an example, the command line, the notebook)",
         "slow: seconds of end-to-end runs on two cores (engines in Triton's interpreter, the bulk of a sweep of cases)")
LEAVE_OUT_EARLIER = '''"""tools/steps.py's own plugin for one stage's run: it leaves out the tests marked `process` or `slow`
of the chapters before {first}; they ran in their own chapter's stage and run again in the last."""
import re


def pytest_collection_modifyitems(config, items):
    def earlier(item):
        number = re.match(r"test_ch(\\d+)_", item.path.name)
        return number is not None and int(number.group(1)) < {first}
    marked = [item for item in items if item.get_closest_marker("process") or item.get_closest_marker("slow")]
    left_out = [item for item in marked if earlier(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
'''


def run_pytest(stage: Path, targets: list[str], *, quiet: bool = True, timeout: float | None = None,
               parallel: bool = False, one_thread: bool = False,
               earlier_from: int = 0) -> subprocess.CompletedProcess:
    """Run pytest on `targets` in a stage, importing the stage's package, not an installed one.

    The run is hermetic: an ini file of its own stands in for any pytest config above the stage (a stage
    under the repository would otherwise take the repository's, `pythonpath` included). It holds only
    pytest-timeout's per-test limit, so that a test that hangs fails with its name. `parallel`: one
    pytest-xdist worker per core (at most WORKERS), each with one torch thread, a test file per worker
    so that its module-scoped engines are built once; the tiny model's small operations gain more from
    two processes than from two threads in one. `one_thread`: one torch thread (runs side by side).
    `earlier_from`: leave out the `process` and `slow` tests of earlier chapters. A run of one process
    starts warm (tools/book/warm.py) where it can."""
    stage, env = Path(stage).resolve(), stage_env(stage)
    workers = min(WORKERS, os.cpu_count() or 1) if parallel and importlib.util.find_spec("xdist") else 1
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    if workers > 1 or one_thread:
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="steps-ini-") as tmp:
        markers = "".join(f"\n    {mark}" for mark in MARKS)
        (ini := Path(tmp) / "pytest.ini").write_text(f"[pytest]\ntimeout = {TEST_TIMEOUT}\nmarkers ={markers}\n")
        plugin = []
        if earlier_from:
            (Path(tmp) / "steps_stage.py").write_text(LEAVE_OUT_EARLIER.format(first=earlier_from))
            env["PYTHONPATH"] += os.pathsep + tmp
            plugin = ["-p", "steps_stage"]
        cmd = [sys.executable, "-m", "pytest", *targets, *plugin, "-p", "no:cacheprovider", "-c", str(ini),
               "--rootdir", str(stage), "--confcutdir", str(stage), *spread, *["-q"] * quiet]
        return run_python(cmd[1:], stage, env, timeout, warm=workers == 1)


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
