# >>> ch08 file: the judge's own test of exercise 08.2
"""Exercise 08.2: every answer in practice/races_08_2.py must be what the hazard checker says when it
replays the scenario.

    python practice/judge.py test 08.2
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from minioverlap.device.hazard import HazardChecker, HazardError

sys.path.insert(0, str(Path(__file__).resolve().parent))


def replay(ops: list[tuple]) -> str:
    """Run the history on a fresh checker: 'race' if it raises HazardError, else 'no race'."""
    h, events = HazardChecker(), {}
    try:
        for op in ops:
            if op[0] == "access":
                _, h.current, kind, table, row, start, stop = op
                h.access(table, [(row, p) for p in range(start, stop)], kind, f"{kind} on {h.current}")
            elif op[0] == "record":
                h.current = op[1]
                events[op[2]] = h.record()
            elif op[0] == "wait":
                h.current = op[1]
                h.wait_event(events[op[2]])
            elif op[0] == "wait_stream":
                h.current = op[1]
                h.wait_stream(op[2])
            else:
                h.host_wait(events[op[1]], op[1])
    except HazardError:
        return "race"
    return "no race"


def test_answer_matches_the_checker():
    """All ten at once, so that the report lists every wrong answer."""
    races = importlib.import_module("races_08_2")          # imported here: a stub fails this test, not collection
    wrong = []
    for number, (title, ops) in sorted(races.SCENARIOS.items()):
        truth, answer = replay(ops), races.ANSWERS.get(number)
        if answer != truth:
            wrong.append(f"scenario {number} ({title}): you said {answer!r}, the checker says {truth!r}")
    assert not wrong, "\n".join(wrong)
