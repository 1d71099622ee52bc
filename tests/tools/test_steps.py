"""Tests of tools/steps.py, the step checker, on the fixture book in tests/tools/fixtures/book.

The fixture is three chapters of a package `minibook`: a file that arrives in ch02 (window.py, file
marker), a function that arrives in ch02 (shout, a block holding exercise 02.1), a ch01 block that ch03
replaces (count_words), a ch01 test that ch03 removes, a bug planted in ch02 (no-bang) that its tests
catch, and a fix tagged in ch03 (off-by-one in windows) with its regression test.
Every test that changes the book works on a copy (`book_copy`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import steps
from book import running  # tools/book/running.py: run_pytest reads its TEST_TIMEOUT

STEPS = Path(steps.__file__)
MARKER_LINE = re.compile(r"^\s*#\s*(>>>|<<<)|^\s*#\|")


def run_steps(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STEPS), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=120)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} should occur once in {path}"
    path.write_text(text.replace(old, new))


def files_of(stage: Path) -> dict[str, str]:
    return {p.relative_to(stage).as_posix(): p.read_text() for p in stage.rglob("*") if p.is_file()}


def later_lines(book: Path, after: int) -> set[str]:
    """The non-blank lines of later blocks (chapter > `after`) in the files of stage `after`."""
    out: set[str] = set()

    def walk(nodes: list, chapter: int) -> None:
        for node in nodes:
            if isinstance(node, str):
                if chapter > after and node.strip():
                    out.add(node.strip())
            else:
                walk(node.body, chapter if node.exercise else max(chapter, node.chapter))

    loaded = steps.load_book(book)
    for rel, source in loaded.sources.items():
        if loaded.files[rel] <= after:
            walk(source.nodes, loaded.files[rel])
    return out


# ---------------------------------------------------------------- stages hold what was taught

def test_stage1_holds_no_line_of_chapters_2_and_3(book: Path, tmp_path: Path) -> None:
    """Stage 1 has only ch01 files, none of the lines that ch02-ch03 add, and a ch01-only registry."""
    stage = steps.build_stage(book, 1, tmp_path / "ch01")
    files = files_of(stage)
    assert set(files) == {"chapters/01-words.md", "chapters/chapters.toml", "examples/ch01_words.py",
                          "minibook/__init__.py", "minibook/words.py", "practice/exercises.toml",
                          "tests/test_ch01_words.py"}
    stage_lines = {line.strip() for text in files.values() for line in text.splitlines()}
    assert later_lines(book, 1) and not (later_lines(book, 1) & stage_lines)
    assert 'return len(text.split(" "))' in files["minibook/words.py"]
    registry = tomllib.loads(files["chapters/chapters.toml"])
    assert [c["number"] for c in registry["chapter"]] == [1]


def test_stage2_holds_ch02_function_and_file_but_old_ch01_block(book: Path, tmp_path: Path) -> None:
    """Stage 2 has window.py (file marker) and shout (block), yet count_words and its test are ch01's."""
    files = files_of(steps.build_stage(book, 2, tmp_path / "ch02"))
    assert "minibook/window.py" in files and "tests/test_ch03_fixes.py" not in files
    assert "def shout(text: str) -> str:" in files["minibook/words.py"]
    assert "    return len(text.split(\" \"))" in files["minibook/words.py"]
    assert "len(text.split())" not in files["minibook/words.py"]
    assert "def test_count_words_counts_empty_words_between_double_spaces" in files["tests/test_ch01_words.py"]
    assert "range(len(items) - size)]" in files["minibook/window.py"]
    assert not files["minibook/window.py"].startswith("# >>>")


def test_stage3_holds_new_block_and_no_marker_lines(book: Path, tmp_path: Path) -> None:
    """Stage 3 has the replacing code, drops the replaced test, and no stage holds a marker or '#|' line."""
    files = files_of(steps.build_stage(book, 3, tmp_path / "ch03"))
    assert "    return len(text.split())" in files["minibook/words.py"]
    assert 'split(" ")' not in files["minibook/words.py"]
    assert "double_spaces" not in files["tests/test_ch01_words.py"]
    assert "range(len(items) - size + 1)]" in files["minibook/window.py"]
    for n in (1, 2, 3):
        for rel, text in files_of(steps.build_stage(book, n, tmp_path / f"s{n}")).items():
            if rel.endswith(".py"):
                assert not [line for line in text.splitlines() if MARKER_LINE.match(line)], rel


def test_last_stage_is_the_source_without_marker_lines(book: Path, tmp_path: Path) -> None:
    """The final stage reads exactly as the source with its marker and '#|' lines taken out."""
    files = files_of(steps.build_stage(book, 3, tmp_path / "ch03"))
    for rel in ("minibook/words.py", "minibook/window.py", "minibook/__init__.py"):
        source = (book / rel).read_text().splitlines()
        assert files[rel].splitlines() == [line for line in source if not MARKER_LINE.match(line)]


def test_load_registry_reads_chapters_and_fixes(book: Path) -> None:
    """The registry gives the package, the chapters in order and the ch03 fix with its test."""
    registry = steps.load_registry(book)
    assert registry.package == "minibook" and registry.numbers == [1, 2, 3]
    assert registry.chapters[1].tests == ["tests/test_ch02_windows.py", "tests/test_ch02_shout.py"]
    assert registry.chapters[2].fixes == [steps.Fix(
        "off-by-one", ["tests/test_ch03_fixes.py::test_last_window_ends_at_the_last_item"])]


def test_binary_files_are_copied_byte_for_byte(book_copy: Path, tmp_path: Path) -> None:
    """A binary file (chapter 01 by default) lands unchanged in every stage; diff names it, nothing more."""
    blob = bytes(range(256)) * 4
    (book_copy / "minibook" / "weights.bin").write_bytes(blob)
    stage = steps.build_stage(book_copy, 2, tmp_path / "ch02")
    assert (stage / "minibook" / "weights.bin").read_bytes() == blob
    out = run_steps(book_copy, "diff", "1").stdout
    assert "binary file added: minibook/weights.bin" in out and "@@" in out


# ---------------------------------------------------------------- running a stage

def test_run_pytest_imports_the_stage_package_and_ignores_outside_config(book: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """run_pytest imports the stage's minibook, not one on PYTHONPATH, and no pytest config above it."""
    decoy = tmp_path / "decoy" / "minibook"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    monkeypatch.setenv("PYTHONPATH", str(decoy.parent))
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "--no-such-option"\n')
    stage = steps.build_stage(book, 1, tmp_path / "build" / "ch01")
    (stage / "tests" / "test_where.py").write_text(
        "import minibook, pathlib\n\ndef test_where():\n"
        f"    assert pathlib.Path(minibook.__file__).parent == pathlib.Path({str(stage)!r}) / 'minibook'\n")
    result = steps.run_pytest(stage, ["tests"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


def test_a_warm_run_is_the_fresh_process_s_run(tmp_path: Path, monkeypatch) -> None:
    """A run of one process starts from the fork server (tools/book/warm.py) and gives what a fresh
    `python -m pytest` gives: its status, its summary, the run's environment, working directory and torch
    threads; and the stage's package is imported fresh, never the server's."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tmp_path / "minibook.py").write_text("WHERE = __file__\n")
    (tests / "test_env.py").write_text(
        "import os, pathlib, sys, torch, minibook\n\n"
        "def test_env():\n"
        f"    assert pathlib.Path(minibook.WHERE).parent == pathlib.Path({str(tmp_path)!r})\n"
        f"    assert os.getcwd() == {str(tmp_path)!r} and os.environ['STEPS_PROBE'] == 'here'\n"
        "    assert torch.get_num_threads() == 1\n\n"
        "def test_fails():\n    assert 1 == 2, 'it failed'\n")
    monkeypatch.setenv("STEPS_PROBE", "here")
    runs = {}
    for fresh in ("1", "0"):
        monkeypatch.setenv("STEPS_FRESH_PROCESSES", fresh)
        runs[fresh] = steps.run_pytest(tmp_path, ["tests"], one_thread=True)
    for r in runs.values():
        assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout and "it failed" in r.stdout, r.stdout + r.stderr


def test_a_warm_run_s_tests_can_spawn_processes(tmp_path: Path) -> None:
    """A test that spawns a process (as the ranks of chapter 20 are spawned) runs in a warm child as in a
    fresh one, whatever script started the check: the spawned process does not import that script again
    (its imports, here `beside`, are on the script's path, not the run's)."""
    tests, driver = tmp_path / "stage" / "tests", tmp_path / "driver"
    tests.mkdir(parents=True)
    driver.mkdir()
    (tests / "test_spawn.py").write_text(
        "import multiprocessing\n\ndef test_spawn():\n"
        "    child = multiprocessing.get_context('spawn').Process(target=print)\n"
        "    child.start()\n    child.join(60)\n    assert child.exitcode == 0\n")
    (driver / "beside.py").write_text("")
    (driver / "run.py").write_text(
        f"import sys\nsys.path.insert(1, {str(STEPS.parent)!r})\nimport beside, steps\n\n"
        f"if __name__ == '__main__':\n"
        f"    r = steps.run_pytest({str(tmp_path / 'stage')!r}, ['tests'])\n"
        f"    print(r.returncode, r.stdout[-300:], r.stderr[-300:])\n")
    r = subprocess.run([sys.executable, str(driver / "run.py")], capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("0 ") and "1 passed" in r.stdout, r.stdout + r.stderr


def test_a_warm_run_that_dies_or_hangs_is_no_failed_test(tmp_path: Path) -> None:
    """A child that ends before pytest returns is not pytest's status 1 ("a test failed": a planted bug
    caught) but 3, pytest's internal error; one that outlives its timeout is 124, as a fresh one's."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_dies.py").write_text("import os\n\ndef test_dies():\n    os._exit(1)\n")
    (tests / "test_hangs.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(60)\n")
    dies = steps.run_pytest(tmp_path, ["tests/test_dies.py"])
    assert dies.returncode == 3 and "before its program returned" in dies.stderr, dies.stderr
    hangs = steps.run_pytest(tmp_path, ["tests/test_hangs.py"], timeout=8)
    assert hangs.returncode == 124 and "timed out after 8s" in hangs.stderr


def test_a_stage_leaves_out_only_the_earlier_chapters_process_and_slow_tests(tmp_path: Path) -> None:
    """earlier_from=N deselects the tests marked `process` or `slow` of chapters before N, and nothing else:
    the chapter's own marked tests, the earlier chapters' other tests and unnamed modules still run."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_ch01_a.py").write_text("import pytest\n\n\n@pytest.mark.process\ndef test_example():\n"
                                          "    assert False, 'ran ch01 process'\n\n\n@pytest.mark.slow\n"
                                          "def test_engine():\n    assert False, 'ran ch01 slow'\n\n\n"
                                          "def test_unit():\n    pass\n")
    (tests / "test_ch02_b.py").write_text("import pytest\n\n\n@pytest.mark.process\ndef test_example():\n"
                                          "    pass\n\n\n@pytest.mark.slow\ndef test_engine():\n    pass\n")
    every = steps.run_pytest(tmp_path, ["tests"])
    assert every.returncode == 1 and "ran ch01 process" in every.stdout and "ran ch01 slow" in every.stdout
    assert "PytestUnknownMarkWarning" not in every.stdout
    stage_2 = steps.run_pytest(tmp_path, ["tests"], earlier_from=2)
    assert stage_2.returncode == 0 and "3 passed, 2 deselected" in stage_2.stdout, stage_2.stdout
    stage_3 = steps.run_pytest(tmp_path, ["tests"], earlier_from=3)
    assert stage_3.returncode == 0 and "1 passed, 4 deselected" in stage_3.stdout, stage_3.stdout


def test_revert_proof_makes_the_registered_test_fail(book: Path, tmp_path: Path) -> None:
    """Stage 3 with fix off-by-one reverted has the old code, and the registered test fails there."""
    test = steps.load_registry(book).chapters[2].fixes[0].tests[0]
    stage = steps.build_stage(book, 3, tmp_path / "ch03")
    reverted = steps.build_stage(book, 3, tmp_path / "ch03-revert", revert="off-by-one")
    assert "range(len(items) - size)]" in (reverted / "minibook" / "window.py").read_text()
    assert "len(text.split())" in (reverted / "minibook" / "words.py").read_text()  # only the fix goes
    assert steps.run_pytest(stage, [test]).returncode == 0
    failed = steps.run_pytest(reverted, [test])
    assert failed.returncode == 1 and "assert [2, 3] == [3, 4]" in failed.stdout


def test_check_passes_on_the_fixture(book: Path) -> None:
    """`check` on the fixture runs every stage's tests and example, the proof and the snippets, and
    ends with the plain line 'N passed, 0 failed'."""
    result = run_steps(book, "check")
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.fullmatch(r"(\d+) passed, 0 failed", lines[-1])
    assert int(lines[-1].split()[0]) == 15
    for name in ("stage 01 tests", "stage 02 example", "stage 03 tests", "proof off-by-one",
                 "bug no-bang", "snippets ch03"):
        assert any(re.match(rf"{name}\s+pass", line) for line in lines), name
    assert "caught by tests/test_ch02_shout.py::test_shout_uppercases_and_adds_a_bang" in result.stdout


def test_check_prints_each_checks_wall_time_and_the_total(book: Path) -> None:
    """Every check line shows its seconds; the line before the closing one is the total."""
    lines = run_steps(book, "check", "--chapters", "1", "--no-proofs").stdout.strip().splitlines()
    assert all(re.match(r"\S.*\s(pass|FAIL)\s+\d+\.\d s", line) for line in lines[:-2]), lines
    assert re.match(r"stage 01 tests\s+pass\s+\d+\.\d s  3 passed", lines[2]), lines[2]
    assert re.fullmatch(r"total \d+\.\d s", lines[-2])


def test_check_fails_when_the_registered_test_misses_the_revert(book_copy: Path) -> None:
    """A fix whose registered test still passes with the fix reverted fails `check`."""
    edit(book_copy / "chapters" / "chapters.toml", "test_last_window_ends_at_the_last_item",
         "test_count_words_ignores_runs_of_whitespace")
    result = run_steps(book_copy, "check", "--chapters", "3")
    assert result.returncode == 1
    assert re.search(r"^proof off-by-one\s+FAIL", result.stdout, re.M)
    assert "passes with fix 'off-by-one' reverted: it does not catch the bug" in result.stdout
    assert re.fullmatch(r"\d+ passed, 1 failed", result.stdout.strip().splitlines()[-1])


def test_check_reports_a_failing_stage_test_with_its_output(book_copy: Path) -> None:
    """A ch02 test that breaks fails 'stage 02 tests' (and later stages) with pytest's tail shown."""
    edit(book_copy / "tests" / "test_ch02_shout.py", '"HI THERE!"', '"HI THERE?"')
    result = run_steps(book_copy, "check", "--chapters", "2", "--no-proofs")
    assert result.returncode == 1
    assert re.search(r"^stage 02 tests\s+FAIL", result.stdout, re.M)
    assert "test_shout_uppercases_and_adds_a_bang" in result.stdout


# ---------------------------------------------------------------- planted bugs

UNCAUGHT = '''
[[chapter.bug]]
name = "extra-window"
file = "minibook/window.py"
pattern = "range(len(items) - size)]"
replacement = "range(len(items) - size + 1)]"

[[chapter.bug]]
name = "no-colon"
file = "minibook/window.py"
pattern = "-> list[list[int]]:"
replacement = "-> list[list[int]]"
tests = ["tests/test_ch02_windows.py"]
'''


def test_check_fails_a_bug_the_tests_miss_or_cannot_run(book_copy: Path) -> None:
    """A planted bug the tests pass with fails `check`; so does one with which they cannot even run."""
    edit(book_copy / "chapters" / "chapters.toml", 'replacement = "text.upper()"\n',
         'replacement = "text.upper()"\n' + UNCAUGHT)
    result = run_steps(book_copy, "check", "--chapters", "2")
    assert result.returncode == 1
    assert re.search(r"^bug no-bang\s+pass", result.stdout, re.M)
    assert re.search(r"^bug extra-window\s+FAIL", result.stdout, re.M)
    assert "the tests do not catch bug extra-window" in result.stdout
    assert re.search(r"^bug no-colon\s+FAIL", result.stdout, re.M)
    assert "bug no-colon: the tests do not run with it planted (pytest exit 2)" in result.stdout
    assert re.fullmatch(r"\d+ passed, 2 failed", result.stdout.strip().splitlines()[-1])


def test_a_bug_caught_only_by_a_test_that_fails_anyway_proves_nothing(book_copy: Path) -> None:
    """When the test that fails with the bug planted fails without it too, the bug is not caught."""
    edit(book_copy / "tests" / "test_ch02_shout.py", '"HI THERE!"', '"HI THERE?"')
    result = run_steps(book_copy, "check", "--chapters", "2")
    assert re.search(r"^bug no-bang\s+FAIL", result.stdout, re.M)
    assert ("bug no-bang: the first test to fail, tests/test_ch02_shout.py::test_shout_uppercases_and_adds_a_bang, "
            "fails without the bug too") in result.stdout


def test_bugs_lists_each_planted_bug_as_a_diff(book: Path) -> None:
    """`bugs 2` shows no-bang as a one-line diff of words.py in stage 2; `bugs 1` has none to show."""
    out = run_steps(book, "bugs", "2").stdout
    assert "bug no-bang, caught by tests/test_ch02_windows.py, tests/test_ch02_shout.py" in out
    assert '--- a/minibook/words.py\n+++ b/minibook/words.py\n' in out
    assert '-    return text.upper() + "!"\n+    return text.upper()\n' in out
    assert run_steps(book, "bugs", "1").stdout.strip() == "chapter 01 plants no bugs"


# ---------------------------------------------------------------- the per-test timeout

def test_a_hanging_stage_test_fails_with_its_name(book: Path, tmp_path: Path, monkeypatch) -> None:
    """run_pytest gives every test pytest-timeout's limit, so a test that hangs fails, named."""
    monkeypatch.setattr(running, "TEST_TIMEOUT", 1)
    stage = steps.build_stage(book, 1, tmp_path / "ch01")
    (stage / "tests" / "test_hang.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(60)\n")
    result = steps.run_pytest(stage, ["tests/test_hang.py"], timeout=50)
    assert result.returncode == 1 and "Timeout" in result.stdout and "test_hangs" in result.stdout


def test_the_repository_tests_have_the_same_timeout() -> None:
    """pyproject.toml's pytest timeout is the one stages get, and pytest-timeout is a dev dependency."""
    project = tomllib.loads((STEPS.parent.parent / "pyproject.toml").read_text())
    assert project["tool"]["pytest"]["ini_options"]["timeout"] == steps.TEST_TIMEOUT
    assert any(d.startswith("pytest-timeout") for d in project["project"]["optional-dependencies"]["dev"])


# ---------------------------------------------------------------- exercises

def test_find_exercises_locates_the_region(book: Path) -> None:
    """find_exercises maps 02.1 to its title, chapter, file and marker line."""
    assert steps.find_exercises(book) == {
        "02.1": steps.ExerciseMarker("02.1", "shout a text", 2, Path("minibook/words.py"), 29)}


def test_stub_replaces_the_region_with_not_implemented(book: Path, tmp_path: Path) -> None:
    """A stub swaps the solution region for one raise at the marker's indentation; its test fails."""
    stage = steps.build_stage(book, 2, tmp_path / "ws", stub="02.1")
    words = (stage / "minibook" / "words.py").read_text()
    assert '    raise NotImplementedError("exercise 02.1: shout a text")' in words.splitlines()
    assert "text.upper()" not in words
    result = steps.run_pytest(stage, ["tests/test_ch02_shout.py"])
    assert result.returncode == 1 and "NotImplementedError: exercise 02.1: shout a text" in result.stdout
    assert steps.run_pytest(stage, ["tests/test_ch02_windows.py"]).returncode == 0


def test_bad_stub_or_revert_names_raise(book: Path, tmp_path: Path) -> None:
    """Stubbing an unknown exercise or reverting a fix the stage does not hold raises MarkerError."""
    with pytest.raises(steps.MarkerError, match="exercise 09.9"):
        steps.build_stage(book, 2, tmp_path / "a", stub="09.9")
    with pytest.raises(steps.MarkerError, match="off-by-one"):
        steps.build_stage(book, 2, tmp_path / "b", revert="off-by-one")


# ---------------------------------------------------------------- structural errors

STRUCTURAL = {
    "unbalanced marker": ("minibook/words.py", "    # <<< exercise 02.1\n# <<< ch02\n", "    # <<< exercise 02.1\n",
                          "minibook/words.py:26: '# >>> ch02' is never closed"),
    "mismatched close": ("minibook/window.py", "    # <<< ch03", "    # <<< ch02",
                         "minibook/window.py:12: '# <<< ch02' closes '# >>> ch03' opened at line 9"),
    "unknown chapter": ("minibook/words.py", "# >>> ch02: shouting", "# >>> ch04: shouting",
                        "minibook/words.py:26: unknown chapter ch04"),
    "replaces a later chapter": ("minibook/words.py", "ch03 replaces ch01", "ch03 replaces ch03",
                                 "minibook/words.py:8: ch03 replaces ch03: it must replace an earlier chapter"),
    "stray old-code line": ("minibook/words.py", "        self.total = 0\n",
                            "        self.total = 0\n        #| self.total = 1\n",
                            "minibook/words.py:19: stray '#|' line"),
    "replaces without old code": ("minibook/words.py", '    #| return len(text.split(" "))\n', "",
                                  "minibook/words.py:8: a 'replaces' marker needs the old code"),
    "malformed marker": ("minibook/words.py", "# >>> ch02: shouting", "# >>> ch02 shouting",
                         "minibook/words.py:26: malformed marker"),
    "registry fix without marker": ("chapters/chapters.toml", "test_last_window_ends_at_the_last_item\"]\n",
                                    "test_last_window_ends_at_the_last_item\"]\n\n"
                                    "[[chapter.fix]]\nname = \"ghost\"\ntests = []\n",
                                    "chapters/chapters.toml:36: fix 'ghost' of ch03 has no marker"),
    "recheck of no earlier fix": ("chapters/chapters.toml", "test_last_window_ends_at_the_last_item\"]\n",
                                  "test_last_window_ends_at_the_last_item\"]\n\n"
                                  "[[chapter.recheck]]\nname = \"off-by-one\"\ntests = []\n",
                                  "chapters/chapters.toml:32: ch03 rechecks 'off-by-one', which is no fix of an earlier chapter"),
    "marker fix not in registry": ("minibook/window.py", "fix off-by-one", "fix off-by-two",
                                   "minibook/window.py:9: fix 'off-by-two' is not in the registry"),
    "inner chapter smaller than outer": ("minibook/words.py", '    """`text` in capitals, with one exclamation mark."""\n',
                                         '    # >>> ch01: too early\n    pass\n    # <<< ch01\n',
                                         "minibook/words.py:28: 'ch01' sits inside ch02 code"),
    "block older than its file": ("minibook/window.py", "ch03 fix off-by-one replaces ch02", "ch03 fix off-by-one replaces ch01",
                                  "minibook/window.py:9: 'ch03' sits inside ch02 code"),
    "registry test missing in its stage": ("chapters/chapters.toml", 'tests = ["tests/test_ch01_words.py"]',
                                           'tests = ["tests/test_ch01_words.py", "tests/test_ch02_shout.py"]',
                                           "chapters/chapters.toml:9: ch01 names tests/test_ch02_shout.py, "
                                           "which arrives in ch02"),
    "bug pattern absent": ("chapters/chapters.toml", """pattern = 'text.upper() + "!"'""", "pattern = 'text.lower()'",
                           "chapters/chapters.toml:19: bug 'no-bang' of ch02: its pattern 'text.lower()' occurs "
                           "0 times in minibook/words.py of stage 02; it must occur exactly once"),
    "bug pattern twice": ("chapters/chapters.toml", """pattern = 'text.upper() + "!"'""", "pattern = '-> int:'",
                          "chapters/chapters.toml:19: bug 'no-bang' of ch02: its pattern '-> int:' occurs 2 times"),
    "bug file not in its stage": ("chapters/chapters.toml", 'file = "minibook/words.py"', 'file = "minibook/gone.py"',
                                  "chapters/chapters.toml:19: bug 'no-bang' of ch02: stage 02 has no minibook/gone.py"),
}


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_structural_error_names_file_and_line(book_copy: Path, tmp_path: Path, case: str) -> None:
    """Each structural error raises MarkerError whose message starts with 'file:line:' and says what."""
    rel, old, new, expected = STRUCTURAL[case]
    edit(book_copy / rel, old, new)
    with pytest.raises(steps.MarkerError) as raised:
        steps.build_stage(book_copy, 3, tmp_path / "stage")
    assert any(e.startswith(expected) for e in raised.value.errors), raised.value.errors


def test_check_lists_every_marker_error_and_fails(book_copy: Path) -> None:
    """`check` reports all marker errors at once, builds nothing, and ends '0 passed, 1 failed'."""
    edit(book_copy / "minibook/window.py", "    # <<< ch03", "    # <<< ch02")
    edit(book_copy / "minibook/words.py", "# >>> ch02: shouting", "# >>> ch04: shouting")
    result = run_steps(book_copy, "check")
    assert result.returncode == 1
    assert "minibook/window.py:12: '# <<< ch02' closes '# >>> ch03' opened at line 9" in result.stdout
    assert "minibook/words.py:26: unknown chapter ch04" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "0 passed, 1 failed"


@pytest.mark.parametrize("line, expected", [
    ("from minibook.window import windows", "examples/ch01_words.py:4: imports module minibook.window, "
                                            "which stage 01 lacks"),
    ("from minibook import shout", "examples/ch01_words.py:4: imports shout from minibook, "
                                   "which stage 01 lacks"),
])
def test_example_importing_what_its_stage_lacks_fails(book_copy: Path, line: str, expected: str) -> None:
    """An example that imports a module or a name its stage lacks fails 'stage NN build' with file:line."""
    edit(book_copy / "examples" / "ch01_words.py", "from minibook import count_words\n",
         f"from minibook import count_words\n{line}\n")
    book = steps.load_book(book_copy)
    stage = steps._build(book, 1, book_copy.parent / "ch01")
    assert steps.stage_import_errors(stage, "minibook", 1) == [expected]
    result = run_steps(book_copy, "check", "--chapters", "1")
    assert result.returncode == 1 and re.search(r"^stage 01 build\s+FAIL", result.stdout, re.M)
    assert expected in result.stdout


# ---------------------------------------------------------------- the rules that keep the source readable

PAIRS = '''def pairs(items: list[int]) -> list[list[int]]:
    """Windows of two."""
    size = 2
    # >>> ch03 replaces ch02: name the copy
    #| copy = items[:]
    #| copy = list(copy)
{more}    copy = list(items)
    # <<< ch03
    return windows(copy, size)
'''
END_OF_WINDOW = "    # <<< ch03\n"  # the last line of window.py: what follows it is a new function
ADD = ('    def add(self, text: str) -> int:\n        """Add the words of `text`; return the running total."""\n'
       "        self.total += count_words(text)\n        return self.total\n")  # Counter.add in words.py

RULES = {
    "marker between a def and its body": (
        "minibook/words.py", '    def add(self, text: str) -> int:\n        """Add the words of `text`; return the running total."""\n',
        '    def add(self, text: str) -> int:\n        # >>> ch02: a docstring\n'
        '        """Add the words of `text`; return the running total."""\n        # <<< ch02\n',
        "minibook/words.py:21: a marker between the header on line 20 and its body"),
    "marker between else: and its body": (
        "minibook/window.py", END_OF_WINDOW,
        END_OF_WINDOW + "\n\ndef first(items: list[int]) -> int:\n    if items:\n        return items[0]\n"
        "    else:\n        # >>> ch03: an empty list gives zero\n        return 0\n        # <<< ch03\n",
        "minibook/window.py:19: a marker between the header on line 18 and its body"),
    "marker inside a docstring": (
        "minibook/words.py", '"""Words: counting them, and (from chapter 02) shouting them."""',
        '"""Words: counting them.\n\n# >>> ch02: and shouting them\n"""',
        "minibook/words.py:3: '# >>> ch02: and shouting them' inside a string: only a comment can be a marker"),
    "nested three deep": (
        "minibook/words.py", ADD,
        "    # >>> ch02: adding\n    # >>> ch03: two deep\n    # >>> ch03: three deep\n" + ADD
        + "    # <<< ch03\n    # <<< ch03\n    # <<< ch02\n",
        "minibook/words.py:22: 'ch03' is nested 3 deep (at most 2"),
    "replaces block that keeps nothing": (
        "tests/test_ch01_words.py", "ch03 removes ch01", "ch03 replaces ch01",
        "tests/test_ch01_words.py:16: 'ch03 replaces ch01' keeps no new code: a removal is written "
        "'ch03 removes ch01'"),
    "removes block with new code": (
        "minibook/words.py", "ch03 replaces ch01", "ch03 removes ch01",
        "minibook/words.py:8: 'ch03 removes ch01' holds new code"),
    "function over its history budget": (
        "minibook/window.py", END_OF_WINDOW,
        END_OF_WINDOW + "\n\n" + PAIRS.format(more="    #| copy = copy[:]\n" * 3),
        "minibook/window.py:15: function pairs spans 12 lines, 7 of them markers or kept old code (58%, at most 40%)"),
    "function of 10 lines with 5 lines of history": (
        "minibook/window.py", END_OF_WINDOW, END_OF_WINDOW + "\n\n" + PAIRS.format(more="    #| copy = copy[:]\n"),
        "minibook/window.py:15: function pairs spans 10 lines, 5 of them markers or kept old code (50%, at most 40%)"),
}


@pytest.mark.parametrize("case", list(RULES))
def test_readability_rule_is_an_error(book_copy: Path, case: str) -> None:
    """Each planted violation is reported, alone, as 'file:line: what'."""
    rel, old, new, expected = RULES[case]
    edit(book_copy / rel, old, new)
    with pytest.raises(steps.MarkerError) as raised:
        steps.load_book(book_copy)
    assert len(raised.value.errors) == 1 and raised.value.errors[0].startswith(expected), raised.value.errors


CLEAN = {
    "markers around the whole statement, a comment between header and body": (
        "minibook/window.py", END_OF_WINDOW,
        END_OF_WINDOW + "\n\ndef first(items: list[int]) -> int:\n    \"\"\"The first item, or zero.\"\"\"\n"
        "    # >>> ch03: an empty list gives zero\n"
        "    if not items:\n        return 0\n    # <<< ch03\n    for item in items:\n        # the first one\n"
        "        return item\n    raise AssertionError\n"),
    "marker-like text in a string, not at a line's start": (
        "minibook/words.py", '"""Words: counting them, and (from chapter 02) shouting them."""',
        '"""Words: counting them.\n\nNot a marker: `# >>> ch02: shouting`.\n# a hash, but no marker\n"""\n'
        'MARK = "# >>> ch02: a one-line string"'),
    "two deep under a file marker": (
        "minibook/window.py", "    return [items[i : i + size] for i in range(len(items) - size + 1)]\n",
        "    # >>> exercise 03.1: windows\n    return [items[i : i + size] for i in range(len(items) - size + 1)]\n"
        "    # <<< exercise 03.1\n"),
    "function at exactly 40% history": (
        "minibook/window.py", END_OF_WINDOW, END_OF_WINDOW + "\n\n" + PAIRS.format(more="    assert size > 0\n")),
    "function of 9 lines over 40% history": (
        "minibook/window.py", END_OF_WINDOW, END_OF_WINDOW + "\n\n" + PAIRS.format(more="")),
}


@pytest.mark.parametrize("case", list(CLEAN))
def test_readability_rule_passes_what_it_allows(book_copy: Path, case: str) -> None:
    """The near misses of each rule load without an error."""
    rel, old, new = CLEAN[case]
    edit(book_copy / rel, old, new)
    steps.load_book(book_copy)


def test_removes_block_gives_old_code_before_and_nothing_after(book_copy: Path, tmp_path: Path) -> None:
    """`fix NAME removes chMM` is a replacing fix with an empty body: the old code until its chapter,
    nothing from it on, the old code again with the fix reverted."""
    window = book_copy / "minibook" / "window.py"
    edit(window, "ch03 fix off-by-one replaces ch02", "ch03 fix off-by-one removes ch02")
    edit(window, "    return [items[i : i + size] for i in range(len(items) - size + 1)]\n", "")
    old = "    return [items[i : i + size] for i in range(len(items) - size)]"
    assert old in (steps.build_stage(book_copy, 2, tmp_path / "2") / "minibook/window.py").read_text()
    assert "return" not in (steps.build_stage(book_copy, 3, tmp_path / "3") / "minibook/window.py").read_text()
    reverted = steps.build_stage(book_copy, 3, tmp_path / "r", revert="off-by-one")
    assert old in (reverted / "minibook/window.py").read_text()


def test_lex_finds_strings_and_header_gaps() -> None:
    """The rules' helpers on a snippet: lines inside strings, and header/body gaps, as tokenize sees them."""
    lexed = steps.lex('def f():\n    # c\n    x = """\n# >>> ch02: s\n"""\nif f:\n    pass\n')
    assert lexed.strings == {4, 5} and lexed.headers == [(1, 3), (6, 7)] and lexed.error is None
    assert steps.lex("x = (\n").error is not None


# ---------------------------------------------------------------- snippets

def test_snippet_source_takes_decorators_and_dedents_methods(tmp_path: Path) -> None:
    """`path::Name` takes the decorators along; `path::Class.method` is dedented; `path` is the file."""
    (tmp_path / "m.py").write_text("import functools\n\n\n@functools.cache\ndef f(x):\n    return x\n\n\n"
                                   "class C:\n    @staticmethod\n    def g():\n        return 1\n")
    assert steps.snippet_source(tmp_path, "m.py::f") == ["@functools.cache", "def f(x):", "    return x"]
    assert steps.snippet_source(tmp_path, "m.py::C.g") == ["@staticmethod", "def g():", "    return 1"]
    assert steps.snippet_source(tmp_path, "m.py")[0] == "import functools"
    with pytest.raises(steps.MarkerError, match="m.py has no C.h"):
        steps.snippet_source(tmp_path, "m.py::C.h")


def test_drifted_snippet_fails_and_write_repairs_it(book_copy: Path) -> None:
    """A source edit that the chapters do not show fails the snippet check; `snippets --write` repairs it."""
    edit(book_copy / "minibook" / "window.py", "Every run of `size` consecutive items, in order.",
         "Each run of `size` neighbouring items.")
    result = run_steps(book_copy, "snippets")
    assert result.returncode == 1
    assert "chapters/02-windows.md:5: snippet minibook/window.py::windows: drifted" in result.stdout
    assert "chapters/03-fixes.md:14: snippet minibook/window.py::windows: drifted" in result.stdout
    assert run_steps(book_copy, "snippets", "--write").returncode == 0
    chapter = (book_copy / "chapters" / "02-windows.md").read_text()
    assert '    """Each run of `size` neighbouring items."""\n    return [items[i : i + size] for i in ' \
           "range(len(items) - size)]\n```" in chapter
    assert run_steps(book_copy, "snippets").returncode == 0


def test_snippet_naming_a_missing_function_is_an_error(book_copy: Path) -> None:
    """A snippet that names a function its stage lacks fails, and --write cannot repair it."""
    edit(book_copy / "chapters" / "01-words.md", "minibook/words.py::count_words", "minibook/words.py::shout")
    result = run_steps(book_copy, "snippets", "--write")
    assert result.returncode == 1
    assert "chapters/01-words.md:5: snippet minibook/words.py::shout: minibook/words.py has no shout" \
        in result.stdout


def test_a_stub_snippet_shows_the_exercise_without_its_answer(book_copy: Path) -> None:
    """`REF stub 02.1` shows shout as the learner gets it: the signature, the docstring and the stub's
    raise. The answer shown under it is drift that --write replaces; an exercise the file lacks is an error."""
    chapter = book_copy / "chapters" / "02-windows.md"
    edit(chapter, "<!-- snippet: minibook/words.py::shout -->", "<!-- snippet: minibook/words.py::shout stub 02.1 -->")
    result = run_steps(book_copy, "snippets")
    assert result.returncode == 1
    assert "chapters/02-windows.md:14: snippet minibook/words.py::shout: drifted" in result.stdout
    assert run_steps(book_copy, "snippets", "--write").returncode == 0
    text = chapter.read_text()
    assert '    """`text` in capitals, with one exclamation mark."""\n    raise NotImplementedError("exercise 02.1: ' \
           'shout a text")\n```' in text
    assert "text.upper()" not in text
    edit(chapter, "shout stub 02.1", "shout stub 02.2")
    result = run_steps(book_copy, "snippets")
    assert result.returncode == 1
    assert "minibook/words.py holds no region of exercise 02.2 in the stage" in result.stdout


# ---------------------------------------------------------------- diff and tree

def test_diff_2_shows_the_added_function_and_file(book: Path) -> None:
    """`diff 2` adds shout to words.py and window.py as a new file, and shows no ch03 code."""
    result = run_steps(book, "diff", "2")
    assert result.returncode == 0
    out = result.stdout
    assert "+def shout(text: str) -> str:" in out
    assert "--- /dev/null\n+++ b/minibook/window.py" in out
    assert "+from minibook.window import windows" in out
    assert "size + 1" not in out and "split()" not in out


def test_diff_code_leaves_the_prose_out(book: Path) -> None:
    """`diff 3 --code` shows the code chapter 03 changes, but not its chapter text or registry entry."""
    full, code = run_steps(book, "diff", "3").stdout, run_steps(book, "diff", "3", "--code").stdout
    assert "+++ b/chapters/03-fixes.md" in full and "+++ b/chapters/chapters.toml" in full
    assert "chapters/" not in code
    assert "+++ b/minibook/window.py" in code and "+++ b/tests/test_ch03_fixes.py" in code


def test_tree_2_marks_the_new_file(book: Path) -> None:
    """`tree 2` marks window.py new and words.py changed, and folds practice/ as unchanged."""
    out = run_steps(book, "tree", "2").stdout
    marks = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert marks["window.py"] == ["new"] and marks["words.py"] == ["changed"]
    assert marks["test_ch01_words.py"] == []
    assert "practice/ (1 file, unchanged)" in out


# ---- exercises that start from earlier code, and exercise regions in the readability rules

REPO = Path(__file__).resolve().parents[2]


def test_an_exercise_from_an_earlier_chapter_starts_from_that_chapters_code(tmp_path: Path) -> None:
    """Exercise 07.1 is marked `from ch06`: its stub is the region as stage 06 had it (the naive result
    handling) under a comment naming the exercise, with no NotImplementedError; the reference keeps
    chapter 07's fixes."""
    stub = steps.build_stage(REPO, 7, tmp_path / "stub", stub="07.1")
    ref = steps.build_stage(REPO, 7, tmp_path / "ref")
    stage6 = steps.build_stage(REPO, 6, tmp_path / "six")

    def handle(stage: Path) -> str:
        text = (stage / "minioverlap/scheduler/output_processor.py").read_text()
        start = text.index("    def handle(")
        end = text.find("\n    def ", start + 1)                  # handle is the file's last method before chapter 09
        return text[start:end if end >= 0 else len(text)]

    assert "# exercise 07.1: repair the naive result handling (this is chapter 06's code)" in handle(stub)
    assert "NotImplementedError" not in handle(stub)
    assert handle(stub).replace("        # exercise 07.1: repair the naive result handling (this is chapter 06's code)\n",
                                "") == handle(stage6)
    assert "req.finish_reason = req.check_stop()" in handle(ref) and "req.check_stop()" not in handle(stub)


def test_exercise_markers_are_no_history_and_add_no_depth() -> None:
    assert steps.is_history("        # >>> ch07 fix stale-reply: drop the token")
    assert steps.is_history("        #| if req.finished:")
    assert not steps.is_history("        # >>> exercise 04.2: handle a step's result")
    assert not steps.is_history("        # <<< exercise 04.2")
    inner = steps.Block("f.py", 3, "", 7, fix="x")
    middle = steps.Block("f.py", 2, "", 4, exercise="04.2", body=[inner])
    outer = steps.Block("f.py", 1, "", 7, exercise="07.1", body=[middle])
    assert steps.depth_errors([outer], 1) == [], "two exercise regions around one chapter block: depth 1"
    deep = steps.Block("f.py", 1, "", 5, body=[steps.Block("f.py", 2, "", 6, body=[steps.Block("f.py", 3, "", 7)])])
    assert steps.depth_errors([deep], 1) != [], "three chapter blocks deep is still an error"


def test_a_stage_that_changes_no_code_runs_only_its_new_tests(tmp_path: Path) -> None:
    """Stage n's tests rerun everything unless n adds only prose and test modules: then only those."""
    before, after = tmp_path / "before", tmp_path / "after"
    for root in (before, after):
        (root / "pkg").mkdir(parents=True)
        (root / "tests").mkdir()
        (root / "chapters").mkdir()
        (root / "pkg" / "engine.py").write_text("X = 1\n")
        (root / "tests" / "test_ch01.py").write_text("def test_x(): pass\n")
    (after / "tests" / "test_ch02.py").write_text("def test_y(): pass\n")
    (after / "chapters" / "02.md").write_text("# two\n")
    assert steps.new_tests(after, None) is None, "no stage before: everything"
    assert steps.new_tests(after, before) == ["tests/test_ch02.py"]
    (after / "tests" / "test_ch01.py").write_text("def test_x(): assert 1\n")
    assert steps.new_tests(after, before) == ["tests/test_ch01.py", "tests/test_ch02.py"]
    (after / "tests" / "conftest.py").write_text("")
    assert steps.new_tests(after, before) is None, "a conftest changes every test"
    (after / "tests" / "conftest.py").unlink()
    (after / "pkg" / "engine.py").write_text("X = 2\n")
    assert steps.new_tests(after, before) is None, "code changed: everything"


# ---------------------------------------------------------------- transcripts, figures and quotes

RUN = {"device": "a test", "copy_GBps": 4236.4,
       "results": [{"shape": "s", "batch": 1, "system": "normal", "tok_s": 100.0, "ms_step": 10.0},
                   {"shape": "s", "batch": 1, "system": "overlap", "tok_s": 118.0, "ms_step": 8.47},
                   {"shape": "s", "batch": 4, "system": "normal", "tok_s": 350.0, "ms_step": 11.4},
                   {"shape": "s", "batch": 4, "system": "overlap", "tok_s": 420.0, "ms_step": 9.5}],
       "profile": {"s": {"top": [{"name": "gemm_a", "ms": 1.25}, {"name": "gemm_b", "ms": 0.5},
                                 {"name": "norm", "ms": 0.25}]}}}
STAGE2_PRINTS = "$ python examples/ch02_windows.py\n[[1, 2], [2, 3]]\nWINDOWS!\n"   # the ch02 bug: one window short
FINAL_PRINTS = "$ python examples/ch02_windows.py\n[[1, 2], [2, 3], [3, 4]]\nWINDOWS!\n"  # fixed in ch03


def add_prose(book: Path, chapter: str, text: str) -> Path:
    """Append `text` to a chapter of the fixture book (after its snippets, which keep their lines)."""
    path = book / "chapters" / chapter
    path.write_text(path.read_text() + "\n" + text)
    return path


def with_run(book: Path) -> None:
    (book / "chapters" / "figures").mkdir(exist_ok=True)
    (book / "chapters" / "figures" / "run.json").write_text(json.dumps(RUN))


def test_a_figure_is_its_expression_over_the_recorded_run(book_copy: Path) -> None:
    """`snippets` recomputes each figure from chapters/figures/*.json at its printed precision; a number
    that differs fails with its line, its expression and the value."""
    with_run(book_copy)
    gain = "results[s, 1, overlap].tok_s / results[s, 1, normal].tok_s"
    md = add_prose(book_copy, "02-windows.md",
                   f"Overlap is 1.18x<!-- fig: run.json {gain} --> as fast, +18%<!-- fig: run.json 100 * ({gain} - 1) -->, "
                   "a step of 8.5 ms<!-- fig: run.json results[s, 1, overlap].ms_step --> at batch 1, and the copies run "
                   "at 4.2 TB/s<!-- fig: run.json copy_GBps / 1000 -->.\n")
    ok = run_steps(book_copy, "snippets")
    assert ok.returncode == 0, ok.stdout
    assert "7 snippets, 4 figures and quotes, 0 wrong" in ok.stdout
    edit(md, "+18%", "+19%")
    wrong = run_steps(book_copy, "snippets")
    assert wrong.returncode == 1
    assert f"chapters/02-windows.md:21: +19 is not 100 * ({gain} - 1) = 18 (run.json)" in wrong.stdout
    edit(md, "+19%", "+18.0%")                         # one decimal more: 18.0 must be 18.0 to one decimal
    assert run_steps(book_copy, "snippets").returncode == 0
    edit(md, "8.5 ms", "8.47 ms")
    assert run_steps(book_copy, "snippets").returncode == 0
    edit(md, "8.47 ms", "8.4 ms")                      # 8.47 is 8.5 at one decimal, not 8.4
    assert "8.4 is not results[s, 1, overlap].ms_step = 8.47" in run_steps(book_copy, "snippets").stdout


def test_min_max_sum_and_mean_take_a_recorded_list_of_numbers() -> None:
    """A run may record a list (each chunk step's ms): min, max, sum and mean read it; alone, or as a list
    of anything but numbers, it is no figure."""
    from book.figures import figure_value
    from book.markers import MarkerError
    data = {"chunk_ms": [48.0, 56.5, 99.9], "names": ["a", "b"]}
    assert figure_value(data, "max(chunk_ms) / min(chunk_ms)", "x") == pytest.approx(99.9 / 48.0)
    assert figure_value(data, "mean(chunk_ms)", "x") == pytest.approx((48.0 + 56.5 + 99.9) / 3)
    with pytest.raises(MarkerError, match="3 items selected where one number is meant"):
        figure_value(data, "chunk_ms", "x")
    with pytest.raises(MarkerError, match="not a number"):
        figure_value(data, "max(names)", "x")


def test_a_table_of_figures_is_checked_row_by_row(book_copy: Path) -> None:
    """`rows:` before a table: each body row's numbers are its expressions, `$1` the row's first cell."""
    with_run(book_copy)
    md = add_prose(book_copy, "02-windows.md",
                   "<!-- fig: run.json rows: results[s, batch=$1, normal].tok_s; results[s, batch=$1, overlap].tok_s -->\n"
                   "| batch | normal | overlap |\n|---|---|---|\n| 1 | 100 | 118 |\n| 4 | 350 | 420 |\n")
    assert run_steps(book_copy, "snippets").returncode == 0
    edit(md, "| 4 | 350 | 420 |", "| 4 | 350 | 402 |")
    wrong = run_steps(book_copy, "snippets")
    assert wrong.returncode == 1
    assert "chapters/02-windows.md:25: 402 is not results[s, batch=4, overlap].tok_s = 420 (run.json)" in wrong.stdout


@pytest.mark.parametrize("comment, expected", [
    ("<!-- fig: nosuch.json copy_GBps -->", "chapters/02-windows.md:21: no file chapters/figures/nosuch.json"),
    ("<!-- fig: run.json results[s, 16, normal].tok_s -->", "nothing in results[s, 16, normal].tok_s matches [s, 16, normal]"),
    ("<!-- fig: run.json results[s, normal].tok_s -->", "2 items selected where one number is meant"),
    ("<!-- fig: run.json copy_gbps -->", "no 'copy_gbps' in copy_gbps"),
    ("<!-- fig: run.json copy_GBps; copy_GBps -->", "2 expressions, but 1 numbers before the comment"),
    ("<!-- fig:run.json copy_GBps -->", "not a figure or quote"),
    ("<!-- out: copies at ~ -->", "no transcript line of this chapter reads `copies at ~`"),
])
def test_a_figure_that_cannot_be_computed_is_an_error(book_copy: Path, comment: str, expected: str) -> None:
    """An unknown file, a path that selects nothing or several items, a misspelt key, more expressions
    than numbers, a malformed comment, a quote of no transcript: each an error, never a warning."""
    with_run(book_copy)
    add_prose(book_copy, "02-windows.md", f"The copies run at 4236{comment}.\n")
    result = run_steps(book_copy, "snippets")
    assert result.returncode == 1 and expected in result.stdout, result.stdout
    assert "1 wrong" in result.stdout


def test_a_transcript_is_what_its_command_prints_in_the_stage_and_the_final_tree(book_copy: Path) -> None:
    """`<!-- output -->` is compared in the chapter's stage and in the final tree: stage 02 prints one window
    short (the ch02 bug), so a transcript of it fails in the final tree, where `output final` must show
    the fixed windows. A wrong line fails `check` as `outputs ch02`, never a warning."""
    md = add_prose(book_copy, "02-windows.md", "<!-- output -->\n```\n" + STAGE2_PRINTS + "```\n")
    result = run_steps(book_copy, "check", "--chapters", "2", "--no-proofs")
    assert re.search(r"^outputs ch02\s+FAIL", result.stdout, re.M), result.stdout
    assert "chapters/02-windows.md:21: output of `python examples/ch02_windows.py` in the final tree: differs" \
        in result.stdout
    assert "in its stage" not in result.stdout, "stage 02 prints exactly this"
    assert "+[[1, 2], [2, 3], [3, 4]]" in result.stdout
    edit(md, STAGE2_PRINTS, FINAL_PRINTS)
    result = run_steps(book_copy, "check", "--chapters", "2", "--no-proofs")
    assert re.search(r"^outputs ch02\s+FAIL", result.stdout, re.M), result.stdout
    assert "chapters/02-windows.md:21: output of `python examples/ch02_windows.py` in its stage: differs" in result.stdout
    assert "in the final tree" not in result.stdout, "the final tree prints exactly this"
    edit(md, "<!-- output -->", "<!-- output final -->")
    result = run_steps(book_copy, "check", "--chapters", "2", "--no-proofs")
    assert result.returncode == 0 and re.search(r"^outputs ch02\s+pass", result.stdout, re.M), result.stdout
    edit(md, "WINDOWS!", "WINDOW!")
    result = run_steps(book_copy, "outputs")
    assert result.returncode == 1 and "-WINDOW!\n+WINDOWS!" in result.stdout
    assert "1 transcripts, 1 wrong" in result.stdout


def test_a_transcript_line_that_changes_from_run_to_run_is_marked(book_copy: Path) -> None:
    """`...` stands for any lines and `~` for one number; every other line must be as printed. A quote
    of a transcript number is checked against the transcript."""
    (book_copy / "examples" / "ch02_timed.py").write_text(
        "import time\nprint('start')\nfor i in range(3):\n    print(f'step {i}: {time.perf_counter_ns() % 997:5d} us')\n"
        "print('3 steps, 2 windows')\n")
    md = add_prose(book_copy, "02-windows.md", "<!-- output -->\n```\n$ python examples/ch02_timed.py\nstart\n"
                   "step 0: ~ us\n...\n3 steps, 2 windows\n```\n\nIt ran 3<!-- out: ~ steps, --> steps.\n")
    assert run_steps(book_copy, "outputs").returncode == 0
    assert run_steps(book_copy, "snippets").returncode == 0
    edit(md, "It ran 3<!--", "It ran 4<!--")
    assert "4 is not what the transcript shows at `~ steps,`: 3" in run_steps(book_copy, "snippets").stdout
    edit(md, "3 steps, 2 windows\n```", "3 steps, 3 windows\n```")
    result = run_steps(book_copy, "outputs")
    assert result.returncode == 1 and "\n-3 steps, 3 windows\n" in result.stdout and "\n+3 steps, 2 windows\n" in result.stdout
    assert steps.shown_matches(["a", "...", "z"], ["a", "z"]) and steps.shown_matches(["a", "..."], ["a", "b", "c"])
    assert steps.shown_matches(["t ~ ms"], ["t    12.5 ms"]) and not steps.shown_matches(["t ~ ms"], ["t fast ms"])
    assert steps.shown_matches(["t ~12.5 ms, ~3 us"], ["t 9 ms, 4 us"]), "`~12.5`: the number one run printed"
    assert not steps.shown_matches(["a", "b"], ["a", "b", "c"]) and not steps.shown_matches(["a"], ["a", "b"])
    assert steps.shown_matches(["a  "], ["a", ""]), "trailing spaces and blank lines aside"


def test_a_transcript_marker_or_command_out_of_the_grammar_is_an_error(book_copy: Path) -> None:
    """A marker not followed by a block, a block without a command, a `$` line that is not the marker's
    command, and a command that is not `python SCRIPT.py` or `minioverlap`: all errors."""
    add_prose(book_copy, "02-windows.md", "<!-- output -->\n```\n[[1, 2]]\n```\n\n"
              "<!-- output: python examples/ch01_words.py -->\n```\n$ python examples/ch02_windows.py\n```\n\n"
              "<!-- output: ls examples -->\n```\nch01_words.py\n```\n\n<!-- output: python examples/nosuch.py -->\n```\n```\n")
    out = run_steps(book_copy, "snippets").stdout
    assert "chapters/02-windows.md:21: the marker names no command and the block has no `$ COMMAND` line" in out
    assert "chapters/02-windows.md:26: the block shows `$ python examples/ch02_windows.py`, the marker names " \
           "`python examples/ch01_words.py`" in out
    out = run_steps(book_copy, "outputs").stdout
    assert "chapters/02-windows.md:31: cannot run `ls examples`" in out
    assert "chapters/02-windows.md:36: cannot run `python examples/nosuch.py`: examples/nosuch.py is not in the tree" in out
