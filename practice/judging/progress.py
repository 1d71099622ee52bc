"""The learner's progress, practice/workspace/progress.json: each exercise's status, the hints seen,
the tests that failed last."""

from __future__ import annotations

import json
from pathlib import Path

from .exercises import Exercise
from .workspace import workspace


def load_progress(root: Path) -> dict[str, dict]:
    """{id: {"status": "started" | "passed", "hints_seen": [index, ...],
    "last_failed": [{"node": node id, "error": what it said}, ...]}}; empty before the first start."""
    path = workspace(root) / "progress.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save_progress(root: Path, progress: dict[str, dict]) -> None:
    ws = workspace(root)
    ws.mkdir(parents=True, exist_ok=True)
    ignore = ws / ".gitignore"  # the learner's work stays out of the book's history
    if not ignore.exists():
        ignore.write_text("*\n")
    (ws / "progress.json").write_text(json.dumps(progress, indent=2, sort_keys=True) + "\n")


def status(root: Path, progress: dict[str, dict], ex: Exercise) -> str:
    stored = progress.get(ex.id, {}).get("status")
    if stored == "passed":
        return "passed"
    return "started" if stored or (workspace(root) / ex.id).is_dir() else "not started"
