"""The exercise judge's modules; practice/judge.py is its command line (tools/README.md: "Where the code is").

    exercises.py   the registry practice/exercises.toml: Exercise, Hint, load_exercises, find_exercise
    workspace.py   practice/workspace/ and laying an exercise's workspace there (held_back, overlay,
                   without_solutions)
    progress.py    practice/workspace/progress.json and each exercise's status
    failures.py    pytest in a workspace and its output read: Failure, parse_failures, covers
    hints.py       which hint comes next, giving it, and what a hint may not say (giveaways)
    console.py     the console and the wording of what the commands print
    commands.py    the learner's commands: list, start, test, hint
    check.py       the author's check: the registry against the markers, stubs fail, references pass

This file holds what they share, REPO and JudgeError, and puts tools/ on the path for their
`import steps` (tools/steps.py; tools/ is not a package).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))


class JudgeError(Exception):
    """A usage error: an unknown exercise, a workspace that is missing or already there."""
