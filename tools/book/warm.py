"""Python commands run from a warm process: the check's runs of one process (the planted bugs, the revert
proofs, the judge's stubs and references, the examples and the chapters' transcripts) start where
importing torch and transformers is done.

A fresh `python -m pytest` of one small test took 5.7 s on two cores, most of it importing torch,
transformers and pytest; forked from a process that had imported them, the same run took 1.0 s. The check
makes some 300 such runs. multiprocessing's fork server imports those libraries once, then forks a child
per run, which starts as a fresh interpreter would but for the libraries already in memory. It never holds the book's package:
the server does not import it, so each child imports the stage's own copy, as a fresh process does.
Linux only (forking after importing torch is not safe everywhere); elsewhere, or with
STEPS_FRESH_PROCESSES=1, `available()` is False and the caller runs a fresh process.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path

PRELOAD = ["torch", "transformers", "safetensors", "numpy", "pytest"]  # never the book's package
_context = None


def available() -> bool:
    return sys.platform == "linux" and os.environ.get("STEPS_FRESH_PROCESSES") != "1"


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_warm(argv: list[str], cwd: Path, env: dict[str, str],
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` (`-m MODULE ARGS` or `SCRIPT.py ARGS`) in `cwd` with environment `env`, run in a child
    of the fork server, its output captured; a timeout comes back as exit status 124, as `running._run`
    gives it."""
    cmd = [sys.executable, *argv]
    with tempfile.TemporaryDirectory(prefix="steps-warm-") as tmp:
        out, err, status = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "status"
        child = _server().Process(target=_child, args=(argv, str(cwd), env, str(out), str(err), str(status)))
        child.start()
        child.join(timeout)
        code = child.exitcode
        if code is None:  # still running at the deadline
            child.kill()
            child.join()
        text = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
        ran = status.read_text() if status.exists() else ""
    if code is None:
        return subprocess.CompletedProcess(cmd, 124, text[0], text[1] + f"timed out after {timeout:.0f}s\n")
    if not ran:  # it died before its program returned: never that program's status (pytest's 1 is "failed")
        return subprocess.CompletedProcess(cmd, 3 if code >= 0 else 128 - code, text[0],
                                           text[1] + f"the warm child exited with {code} before its program returned\n")
    return subprocess.CompletedProcess(cmd, int(ran), *text)


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, status: str) -> None:
    """In the forked child: become the process `python ARGV` would be, run it, note its exit status. The
    environment, the working directory and the import path are the run's: the script's folder (with -m the
    working directory), then PYTHONPATH's entries, then the interpreter's own (the server's script folder
    left out), so that the stage's package is the one imported."""
    os.chdir(cwd)
    sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's script: a process the run
    # spawns (the ranks) would import it again, and that script's imports are not on this run's path
    os.environ.clear()
    os.environ.update(env)
    first = cwd if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    own = [p for p in sys.path if p and p.startswith((sys.prefix, sys.base_prefix))]
    sys.path[:] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *own]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    if env.get("OMP_NUM_THREADS"):  # a fresh process reads it at import; here torch is imported already
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out), (2, err)):  # what its own processes print goes there too
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]   # run_module puts the module's file first, as -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter ends on it: None is 0, a number itself, anything else 1, printed
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(status).write_text(str(code))  # then multiprocessing ends the child as a process ends: its
    # threads joined, its finalizers run (the semaphores a test's processes left), its output flushed
