"""Running pytest in a workspace and reading its output: which tests failed, where, and what they said."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import steps  # tools/steps.py: importing judging put tools/ on the path

SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt|Warning)\b")
FILE_LINE = re.compile(r'^File "(.+)", line (\d+)')
# `____ test_x ____`: pytest centres a head in underscores, as few as one each side for a long name
# (`_ test_a_long_name[case] _`); a traceback's `_ _ _ _` between frames is no head
SECTION_HEAD = re.compile(r"^_+ (?:ERROR (?:collecting|at \w+ of) )?([^_ ].*?) _+$")
LOCATION_LINE = re.compile(r"^(\S+\.py):(\d+): \w+$")     # `tests/test_x.py:89: AssertionError`


@dataclass(frozen=True)
class Failure:
    node: str      # a pytest node id, or a file for a collection error
    message: str   # the assertion or exception line
    details: tuple[str, ...] = ()   # where it failed, the failing line, then the first lines of the error

    @property
    def error(self) -> str:
        """Everything the failure says besides its name: what a hint's `when` is also matched against."""
        return "\n".join([self.message, *self.details]).strip()


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
