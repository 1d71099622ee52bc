"""Tests of practice/judge.py, the exercise judge, on copies of the fixture book (tests/tools/fixtures/book).

The fixture's one exercise is 02.1, `shout` in minibook/words.py (reference: `text.upper() + "!"`),
tested by tests/test_ch02_shout.py, with two hints, the second of which (the last) is its solution.
Each test works on its own copy (`book_copy`) and calls the judge's `main` in-process; only the
pytest runs it starts are subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JUDGE = REPO / "practice" / "judge.py"
_spec = importlib.util.spec_from_file_location("judge", JUDGE)
judge = importlib.util.module_from_spec(_spec)
sys.modules["judge"] = judge  # dataclasses look their module up there
_spec.loader.exec_module(judge)

WORKFILE = "practice/workspace/02.1/minibook/words.py"
STUB = 'raise NotImplementedError("exercise 02.1: shout a text")'
TEST_NODE = "tests/test_ch02_shout.py::test_shout_uppercases_and_adds_a_bang"


def run(capsys: pytest.CaptureFixture[str], book: Path, *args: str) -> tuple[int, str, str]:
    """The judge's exit code, stdout and stderr for `judge.py --root BOOK ARGS`."""
    code = judge.main(["--root", str(book), *args])
    out, err = capsys.readouterr()
    return code, out, err


def solve(book: Path, body: str) -> None:
    """Replace the stub's raise in the workspace with the learner's `body` (one line)."""
    path = book / WORKFILE
    text = path.read_text()
    assert STUB in text, "the workspace should still hold the stub"
    path.write_text(text.replace(STUB, body))


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} should occur once in {path}"
    path.write_text(text.replace(old, new))


def add_exercise(book: Path, entry: str) -> None:
    with (book / "practice" / "exercises.toml").open("a") as registry:
        registry.write("\n[[exercise]]\n" + entry)


# ---------------------------------------------------------------- the learner's loop


def test_check_passes_on_the_fixture_book(book_copy, capsys):
    """The fixture's stub fails its test and its reference passes it: the author's check is green."""
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 0, out
    assert "02.1 shout a text" in out
    assert out.splitlines()[-1] == "1 passed, 0 failed"


def test_untouched_stub_fails_test_and_names_the_file_and_line_to_edit(book_copy, capsys):
    """`start` lays the stub; `test` on it says the exercise is not implemented and where to write it."""
    code, out, _ = run(capsys, book_copy, "start", "02.1")
    assert code == 0
    lines = (book_copy / WORKFILE).read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if STUB in text)
    assert f"{WORKFILE}:{line}" in out
    assert "test 02.1" in out

    code, out, _ = run(capsys, book_copy, "test", "02.1")
    assert code == 1
    assert f"exercise 02.1 is not implemented yet: edit {WORKFILE}:{line}" in out
    progress = json.loads((book_copy / "practice/workspace/progress.json").read_text())
    assert progress["02.1"]["status"] == "started"


def test_reference_solution_passes_test_and_records_progress(book_copy, capsys):
    """The reference written into the workspace passes; progress.json and `list` say so."""
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, 'return text.upper() + "!"')
    code, out, _ = run(capsys, book_copy, "test", "02.1")
    assert code == 0, out
    assert "exercise 02.1 passed" in out
    assert "all 1 exercises passed" in out  # no next exercise: the fixture has one
    progress = json.loads((book_copy / "practice/workspace/progress.json").read_text())
    assert progress["02.1"]["status"] == "passed"
    code, out, _ = run(capsys, book_copy, "list")
    assert "1/1 passed" in out and "minibook/words.py" in out


def test_wrong_solution_shows_the_failed_test_its_assertion_and_the_next_hint(book_copy, capsys):
    """A wrong answer names the failed test, where it failed, the failing line and the assertion with
    its values, then gives hint 1; the next failure says there are no more hints, and never gives the
    last one, which is the solution."""
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, "return text.upper()")
    code, out, _ = run(capsys, book_copy, "test", "02.1")
    assert code == 1
    assert TEST_NODE in out
    assert "practice/workspace/02.1/tests/test_ch02_shout.py:6" in out
    assert '> assert shout("hi there") == "HI THERE!"' in out
    assert "AssertionError: assert 'HI THERE' == 'HI THERE!'" in out
    assert "hint 1/1 for 02.1: str.upper() gives the capitals." in out
    assert "not implemented" not in out
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "hint 1/1" not in out and "no more hints for exercise 02.1" in out
    assert "Then add one '!'." not in out and "hint 02.1 --solution" in out


def test_hint_shows_hints_in_order_and_the_solution_only_when_asked(book_copy, capsys):
    """`hint` gives the next unseen hint (remembered across runs) and never the last, the solution;
    `--solution` shows the solution alone, `--all` every hint with the solution last."""
    outs = [run(capsys, book_copy, "hint", "02.1")[1] for _ in range(3)]
    assert "hint 1/1 for 02.1: str.upper() gives the capitals." in outs[0]
    assert all("no more hints" in out and "Then add one" not in out for out in outs[1:])
    _, out, _ = run(capsys, book_copy, "hint", "02.1", "--solution")
    assert out.strip() == "solution for 02.1: Then add one '!'."
    _, out, _ = run(capsys, book_copy, "hint", "02.1", "--all")
    assert out.index("hint 1/1 for 02.1: str.upper()") < out.index("solution for 02.1: Then add one '!'.")


def test_a_hint_with_when_comes_first_for_its_failing_test_and_never_for_another(book_copy, capsys):
    """A hint whose `when` names a failed test is given before the general ones; while only another
    test fails, it is not given, and `hint` (no test run in between) follows the last failure too."""
    (book_copy / "tests/test_ch02_empty.py").write_text(
        "from minibook import shout\n\n\ndef test_shout_of_nothing_is_a_bang():\n    assert shout('') == '!'\n")
    edit(book_copy / "practice/exercises.toml", f'tests = ["{TEST_NODE}"]',
         f'tests = ["{TEST_NODE}", "tests/test_ch02_empty.py::test_shout_of_nothing_is_a_bang"]')
    edit(book_copy / "practice/exercises.toml", "hints = [", 'hints = [{ text = "Even nothing gets its bang.", '
         'when = "of_nothing" }, { text = "Capitals first.", when = "uppercases" }, ')
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, 'return text.upper() + "!" if text else ""')     # only the empty text goes wrong
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "test_shout_of_nothing_is_a_bang" in out and "test_shout_uppercases" not in out
    assert "hint 1/3 for 02.1 (when of_nothing fails): Even nothing gets its bang." in out
    _, out, _ = run(capsys, book_copy, "hint", "02.1")
    assert "hint 3/3 for 02.1: str.upper() gives the capitals." in out       # general; not "Capitals first."
    _, out, _ = run(capsys, book_copy, "hint", "02.1")
    assert "no more hints for the tests that failed (2 of 3 hints seen)" in out and "Capitals" not in out
    solve_again = (book_copy / WORKFILE).read_text().replace('return text.upper() + "!" if text else ""',
                                                            'return text + "!"')
    (book_copy / WORKFILE).write_text(solve_again)
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "hint 2/3 for 02.1 (when uppercases fails): Capitals first." in out


def test_a_hint_whose_when_is_in_the_error_comes_before_one_for_the_tests_name(book_copy, capsys):
    """Hints follow what failed, not the registry's order: a test named after one bug that fails with
    another's error (07.1: early_finish failing with the stale reply's double free, `list.remove(x): x
    not in list`) gets the hint for the error first; the hint for its name comes next, and `hint`,
    with no test run between, still knows the error."""
    edit(book_copy / "practice/exercises.toml", "hints = [",
         'hints = [{ text = "Capitals first.", when = "uppercases" }, '
         '{ text = "Something was freed twice.", when = "x not in list" }, ')
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, "[].remove(text); return text.upper()")     # a double free, of a kind
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "ValueError: list.remove(x): x not in list" in out
    assert "hint 2/3 for 02.1 (on `x not in list`): Something was freed twice." in out
    assert "Capitals first." not in out
    _, out, _ = run(capsys, book_copy, "hint", "02.1")
    assert "hint 1/3 for 02.1 (when uppercases fails): Capitals first." in out
    _, out, _ = run(capsys, book_copy, "hint", "02.1")
    assert "hint 3/3 for 02.1: str.upper() gives the capitals." in out


def test_a_long_assertion_is_shown_whole_up_to_a_limit_and_verbose_shows_everything(book_copy, capsys):
    """An assertion message of several lines is shown line by line (not cut after its first); past
    the limit the rest is left to `--verbose`, which prints pytest's whole output as well."""
    lines = [f"client {k} (max_tokens {k}): normal {k} tokens, overlap {k - 1}" for k in range(20)]
    (book_copy / "tests/test_ch02_clients.py").write_text(
        "from minibook import shout\n\n\ndef test_every_client_gets_its_tokens():\n"
        "    lines = [f'client {k} (max_tokens {k}): normal {k} tokens, overlap {k - 1}' for k in range(20)]\n"
        "    assert shout('a') == 'A!!', 'the clients:\\n' + '\\n'.join(lines)\n")
    edit(book_copy / "practice/exercises.toml", f'tests = ["{TEST_NODE}"]',
         'tests = ["tests/test_ch02_clients.py::test_every_client_gets_its_tokens"]')
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, 'return text.upper() + "!"')
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "AssertionError: the clients:" in out
    assert all(line in out for line in lines[:8]) and lines[-1] not in out
    assert "more lines: `python practice/judge.py --root" in out and "test 02.1 --verbose`" in out
    _, out, _ = run(capsys, book_copy, "test", "02.1", "--verbose")
    assert all(line in out for line in lines)
    assert "short test summary info" in out and "def test_every_client_gets_its_tokens" in out
    assert "more lines" not in out


def test_a_long_parametrized_test_name_keeps_its_failures_details(book_copy, capsys):
    """pytest centres a long test's section head in one or two underscores a side, not three: the
    judge still finds its section and shows where it failed and the assertion with its values."""
    name = "test_shout_uppercases_every_letter_and_adds_exactly_one_bang_at_the_end_of_the_text"
    (book_copy / "tests/test_ch02_long.py").write_text(
        "import pytest\n\nfrom minibook import shout\n\n\n"
        "@pytest.mark.parametrize('text,want', [('hi there, every reader', 'HI THERE, EVERY READER!')])\n"
        f"def {name}(text, want):\n    assert shout(text) == want\n")
    edit(book_copy / "practice/exercises.toml", f'tests = ["{TEST_NODE}"]',
         f'tests = ["tests/test_ch02_long.py::{name}"]')
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, "return text.upper()")
    _, out, _ = run(capsys, book_copy, "test", "02.1", "--verbose")
    heads = [line for line in out.splitlines() if name in line and line.startswith("_")]
    assert heads and all(not line.startswith("___ ") for line in heads)      # the long head pytest prints
    _, out, _ = run(capsys, book_copy, "test", "02.1")
    assert "practice/workspace/02.1/tests/test_ch02_long.py:8" in out
    assert "> assert shout(text) == want" in out
    assert "AssertionError: assert 'HI THERE, EVERY READER' == 'HI THERE, EVERY READER!'" in out


def test_a_traceback_s_frame_separator_is_no_section_head():
    """`_ _ _ _` between a traceback's frames does not start a section: the failure's lines go on."""
    assert judge.SECTION_HEAD.match("_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _") is None
    assert judge.SECTION_HEAD.match("_ test_a[x] _")[1] == "test_a[x]"
    assert judge.SECTION_HEAD.match("____ ERROR collecting tests/test_x.py ____")[1] == "tests/test_x.py"


def test_start_twice_without_force_refuses_and_keeps_the_learners_file(book_copy, capsys):
    """A second `start` would erase the learner's work: it refuses unless --force."""
    run(capsys, book_copy, "start", "02.1")
    solve(book_copy, "return 'my work'")
    code, _, err = run(capsys, book_copy, "start", "02.1")
    assert code == 2
    assert "already exists" in err and "--force" in err
    assert "return 'my work'" in (book_copy / WORKFILE).read_text()
    code, _, _ = run(capsys, book_copy, "start", "02.1", "--force")
    assert code == 0
    assert STUB in (book_copy / WORKFILE).read_text()


def test_the_workspace_s_registry_holds_every_hint_but_the_solution(book_copy, capsys):
    """The stage copies practice/exercises.toml whole; a workspace's copy keeps the exercises, their
    tests and hints, and in place of each solution says where to ask for it. `hint --solution` still
    gives it (it reads the repository's registry)."""
    run(capsys, book_copy, "start", "02.1")
    copy = (book_copy / "practice/workspace/02.1/practice/exercises.toml").read_text()
    assert "str.upper() gives the capitals." in copy and TEST_NODE in copy
    assert "Then add one '!'." not in copy
    assert "python practice/judge.py hint 02.1 --solution" in copy
    assert judge.load_exercises(book_copy / "practice/workspace/02.1")[0].tests == [TEST_NODE]
    _, out, _ = run(capsys, book_copy, "hint", "02.1", "--solution")
    assert "Then add one '!'." in out


def test_unknown_exercise_is_an_error_naming_the_known_ones(book_copy, capsys):
    """A wrong id names itself and the ids that exist."""
    code, out, err = run(capsys, book_copy, "test", "09.9")
    assert code == 2
    assert "unknown exercise '09.9': known are 02.1" in err


def test_test_before_start_says_to_run_start(book_copy, capsys):
    """`test` without a workspace points to `start`, not to a pytest error."""
    code, _, err = run(capsys, book_copy, "test", "02.1")
    assert code == 2
    assert "not started" in err and "start 02.1" in err


def test_the_script_runs_with_root_after_the_command(book_copy):
    """`python practice/judge.py list --root DIR` works as a script, --root after the command too."""
    result = subprocess.run([sys.executable, str(JUDGE), "list", "--root", str(book_copy)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "02.1" in result.stdout and "0/1 passed" in result.stdout


def test_list_shows_a_long_file_path_whole_when_stdout_is_not_a_terminal(book_copy):
    """Piped, rich assumes 80 columns and would cut the table's file column (`minibook/punc…`): the
    path to edit is shown whole, on one line, with COLUMNS unset or 80."""
    long = "minibook/punctuation/exclamation_marks_for_every_text_that_needs_shouting.py"
    (book_copy / long).parent.mkdir()
    (book_copy / long).write_text('def exclaim(text: str) -> str:\n    """`text` with a bang."""\n'
                                  '    # >>> exercise 01.1: exclaim a text, loudly and at length\n'
                                  '    return text + "!"\n    # <<< exercise 01.1\n')
    add_exercise(book_copy, f'id = "01.1"\ntitle = "exclaim a text, loudly and at length"\n'
                            f'tests = ["{TEST_NODE}"]\nhints = ["A bang.", "text + the bang"]\n')
    env = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    for columns in (None, "80"):
        result = subprocess.run([sys.executable, str(JUDGE), "list", "--root", str(book_copy)],
                                capture_output=True, text=True, timeout=60,
                                env=env if columns is None else {**env, "COLUMNS": columns})
        assert result.returncode == 0, result.stderr
        rows = [line for line in result.stdout.splitlines() if "01.1" in line and long in line]
        assert rows, f"COLUMNS={columns}: the row of 01.1 is cut:\n{result.stdout}"
        assert "exclaim a text" in result.stdout and "minibook/words.py" in result.stdout


# ---------------------------------------------------------------- hints do not give the solution away


def test_no_hint_but_the_last_writes_a_piece_of_its_exercises_reference_code():
    """In the book's registry, every hint but the last (the solution, which only `--solution` shows)
    is compared with the exercise's reference region, as the judge finds it in the source: none may
    hold a whole statement of it, or an expression of three operands or more (spaces, quotes and
    `self.` aside). The comparison is live: each region, pasted whole into a hint, is caught, and so is
    11.1's old hint, which spelled out `seq_len + 2*window`."""
    code = judge.reference_code(REPO)
    exercises = judge.load_exercises(REPO)
    for ex in exercises:
        region = code.get(ex.id)
        assert region, f"{ex.id}: no reference region found"
        assert judge.giveaways("\n".join(region), region), f"{ex.id}: its region, whole, is not caught"
    found = {f"{ex.id} hint {number}": judge.giveaways(hint.text, code[ex.id])
             for ex in exercises for number, hint in enumerate(ex.clues, 1)}
    assert {where: pieces for where, pieces in found.items() if pieces} == {}
    old = "... and writes window positions from there: its last position is at most seq_len + 2*window - 1."
    assert judge.giveaways(old, code["11.1"]) == ["seq_len + 2 * window"]
    for hint in judge.find_exercise(exercises, "11.1").clues:     # the case: nor the rule's shape
        assert "max(" not in hint.text and "2*window" not in re.sub(r"\s", "", hint.text)


def test_check_fails_when_a_hint_before_the_last_writes_the_solution(book_copy, capsys):
    """A hint that holds a statement of the reference (`return text.upper() + '!'`) gives the answer
    away before the learner asks for it: the check names the hint and the piece."""
    edit(book_copy / "practice/exercises.toml", "hints = [", "hints = [\"Write return text.upper() + '!'.\", ")
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert """hint 1 gives the solution away: it holds the reference's `return text.upper() + "!"`""" in out


# ---------------------------------------------------------------- the author's check fails


def test_check_of_named_exercises_runs_only_those_and_refuses_an_unknown_one(book_copy, capsys):
    """`check 02.1` proves 02.1 alone; `check 09.9` names the exercises there are."""
    code, out, _ = run(capsys, book_copy, "check", "02.1")
    assert code == 0 and "✔ 02.1 shout a text" in out and out.rstrip().endswith("1 passed, 0 failed")
    code, _, err = run(capsys, book_copy, "check", "09.9")
    assert code == 2 and "no exercise 09.9; the exercises: 02.1" in err


def test_check_fails_when_a_registry_exercise_has_no_marker(book_copy, capsys):
    """An exercise listed in practice/exercises.toml but never marked in the source fails the check."""
    add_exercise(book_copy, f'id = "02.2"\ntitle = "ghost"\ntests = ["{TEST_NODE}"]\nhints = ["boo"]\n')
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "02.2 ghost" in out and "no `# >>> exercise 02.2: ...` marker" in out
    assert out.splitlines()[-1] == "1 passed, 1 failed"


def test_check_fails_when_a_marker_has_no_registry_entry(book_copy, capsys):
    """A solution region the registry does not list fails the check."""
    edit(book_copy / "minibook/words.py", "        self.total += count_words(text)\n",
         "        # >>> exercise 01.1: add up\n        self.total += count_words(text)\n"
         "        # <<< exercise 01.1\n")
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "marker `# >>> exercise 01.1` at minibook/words.py:" in out and "has no entry" in out


def test_check_fails_when_a_hint_names_no_test_of_its_exercise(book_copy, capsys):
    """A `when` that matches none of the exercise's tests could never be given: the check says so, and
    a hint that is neither a string nor a table of text and when is refused when the registry loads."""
    edit(book_copy / "practice/exercises.toml", "hints = [", 'hints = [{ text = "x", when = "test_nowhere" }, ')
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "hint 1: when = 'test_nowhere' is in none of its tests" in out
    edit(book_copy / "practice/exercises.toml", '{ text = "x", when = "test_nowhere" }', "{ txt = 1 }")
    code, _, err = run(capsys, book_copy, "list")
    assert code == 2 and "a hint must be a string or { text" in err


def test_check_proves_a_when_of_error_text_on_the_stubs_failures(book_copy, capsys):
    """A `when` that is part of no test's name must be in what the tests say when they fail on the
    stub (here its NotImplementedError), else the hint could never be given; a list may mix both."""
    edit(book_copy / "practice/exercises.toml", "hints = [", 'hints = [{ text = "x", when = ["uppercases", '
         '"NotImplementedError: exercise 02.1"] }, { text = "y", when = "x not in list" }, ')
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "hint 2: when = 'x not in list' is in none of its tests' names, nor in what they say" in out
    assert "hint 1" not in out
    _, out, _ = run(capsys, book_copy, "hint", "02.1", "--all")
    assert "hint 1/3 for 02.1 (when uppercases fails, or on `NotImplementedError: exercise 02.1`): x" in out


def test_check_fails_when_an_exercise_has_no_tests_or_hints(book_copy, capsys):
    """Every exercise needs at least one test and one hint."""
    edit(book_copy / "practice/exercises.toml", f'tests = ["{TEST_NODE}"]', "tests = []")
    edit(book_copy / "practice/exercises.toml", "hints = [", "unused = [")
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "lists no tests" in out and "has no hints" in out


def test_check_fails_when_the_stub_passes_a_test_that_skips_the_region(book_copy, capsys):
    """A listed test that never calls shout() passes on the stub: it cannot catch a missing solution."""
    other = "tests/test_ch02_windows.py::test_windows_have_the_requested_size"
    edit(book_copy / "practice/exercises.toml", TEST_NODE, other)
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert f"the stub passes {other}" in out
    assert out.splitlines()[-1] == "0 passed, 1 failed"


def test_check_fails_when_the_reference_fails_a_listed_test(book_copy, capsys):
    """A listed test the reference solution fails is reported with its assertion."""
    (book_copy / "tests/test_ch02_strict.py").write_text(
        "from minibook import shout\n\n\ndef test_shout_adds_two_bangs():\n"
        "    assert shout('a') == 'A!!'\n")
    edit(book_copy / "practice/exercises.toml", f'"{TEST_NODE}"',
         f'"{TEST_NODE}", "tests/test_ch02_strict.py::test_shout_adds_two_bangs"')
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "the reference fails: tests/test_ch02_strict.py::test_shout_adds_two_bangs" in out
    assert "assert 'A!' == 'A!!'" in out


def test_check_leaves_out_only_the_targets_its_chapter_s_stage_passed(book_copy, capsys):
    """`--stage-tests-passed 2` (the step checker's stage 02 passed its tests just now, on the reference's
    very tree): the reference's targets in tests/test_ch02_*.py are not run again, so even one that would
    fail is not seen here; told of other chapters, the judge runs them and finds it."""
    (book_copy / "tests/test_ch02_strict.py").write_text(
        "from minibook import shout\n\n\ndef test_shout_adds_two_bangs():\n"
        "    assert shout('a') == 'A!!'\n")
    edit(book_copy / "practice/exercises.toml", f'"{TEST_NODE}"',
         f'"{TEST_NODE}", "tests/test_ch02_strict.py::test_shout_adds_two_bangs"')
    code, out, _ = run(capsys, book_copy, "check", "--stage-tests-passed", "2")
    assert (code, out.splitlines()[-1]) == (0, "1 passed, 0 failed"), out
    code, out, _ = run(capsys, book_copy, "check", "--stage-tests-passed", "1,3")
    assert code == 1 and "the reference fails: tests/test_ch02_strict.py::test_shout_adds_two_bangs" in out
    with pytest.raises(SystemExit):
        judge.main(["--root", str(book_copy), "check", "--stage-tests-passed", "two"])
    assert "chapter numbers separated by commas, not 'two'" in capsys.readouterr().err


def test_check_fails_when_a_listed_test_file_is_not_in_the_stage(book_copy, capsys):
    """A test file of a later chapter (or none) is missing in the exercise's stage."""
    edit(book_copy / "practice/exercises.toml", TEST_NODE,
         "tests/test_ch03_fixes.py::test_last_window_ends_at_the_last_item")
    code, out, _ = run(capsys, book_copy, "check")
    assert code == 1
    assert "test file tests/test_ch03_fixes.py is not in stage 02" in out



# ---------------------------------------------------------------- a workspace holds no answer still to come


# later chapters' exercises whose regions are an earlier chapter's code, which its stages run
EARLIER_CODE = {"12.1"}


def squeezed(lines: list[str]) -> str:
    """Lines without their indentation and without blank ones: a region compared wherever it is laid."""
    return "\n".join(line.strip() for line in lines if line.strip())


def test_no_workspace_holds_the_answer_of_an_exercise_still_to_come(tmp_path):
    """Every exercise of the book, its workspace laid as `start` lays it: no file of it (code, chapters,
    registries) holds the reference region of a later exercise, the region as its own chapter's stage
    holds it, indentation aside; nor a later exercise's solution, its last hint. The later exercises are
    those after it in the book's order, of its chapter, in any file (16.1's workspace held 16.2's
    receive step in scheduler.py, 18.1's, 19.1's and 20.1's the next exercise's answer in another file).
    A later chapter's region that the stage holds is code an earlier chapter runs (handle_window, 12.1's
    answer, is chapter 09's): it stays, and no other case of it is allowed to appear unnoticed. Every
    workspace held every solution in its copy of practice/exercises.toml."""
    book = judge.steps.load_book(REPO)
    exercises, code = judge.load_exercises(REPO), judge.reference_code(REPO)
    leaks = []
    for ex in exercises:
        stage = judge.lay_workspace(REPO, ex, tmp_path / ex.id, book=book)
        texts = {path.relative_to(stage).as_posix(): path.read_text() for path in stage.rglob("*")
                 if path.suffix in (".py", ".md", ".toml") and path.is_file()}
        flat = {rel: squeezed(text.splitlines()) for rel, text in texts.items()}
        for later in (other for other in exercises if other.order > ex.order):
            region, solution = squeezed(code[later.id]), later.solution.text
            if later.chapter > ex.chapter and later.id in EARLIER_CODE:
                region = "\0"                          # the stage runs it: no leak to look for
            leaks += [f"{ex.id}: {later.id}'s answer in {rel}" for rel, text in flat.items() if region in text]
            leaks += [f"{ex.id}: {later.id}'s solution in {rel}" for rel, text in texts.items() if solution in text]
    assert not leaks, "answers still to come in a workspace:\n" + "\n".join(leaks)
