"""Shared fixtures of the tools' tests: the fixture book and throwaway copies of it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = Path(__file__).resolve().parent / "fixtures" / "book"
sys.path.insert(0, str(ROOT / "tools"))

# The fixture book has tests of its own (tests/test_ch0N_*.py); they run inside its stages only.
collect_ignore = ["fixtures"]


@pytest.fixture
def book() -> Path:
    """The fixture book, read-only: tests that change anything use `book_copy`."""
    return BOOK


@pytest.fixture
def book_copy(tmp_path: Path) -> Path:
    """A private copy of the fixture book that a test may edit."""
    dest = tmp_path / "book"
    shutil.copytree(BOOK, dest, ignore=shutil.ignore_patterns("__pycache__", "build", ".pytest_cache"))
    return dest
