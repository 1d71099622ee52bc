"""The commands that show what a chapter changed: `diff` (stage N-1 -> N), `tree` (stage N's files, new
and changed marked) and `bugs` (chapter N's planted bugs, each a diff of stage N).
"""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from .report import say
from .stages import Book, _build, is_prose, stage_text


def two_stages(book: Book, n: int, tmp: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The files of the stage before n (none before the first chapter) and of stage n."""
    def read(stage: Path) -> dict[str, bytes]:
        return {p.relative_to(stage).as_posix(): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    earlier = [c for c in book.registry.numbers if c < n]
    before = read(_build(book, earlier[-1], tmp / "before")) if earlier else {}
    return before, read(_build(book, n, tmp / "after"))


def as_text(data: bytes | None) -> str | None:
    """A file's text ("" if absent), or None if it is binary."""
    try:
        return None if b"\0" in (data or b"") else (data or b"").decode()
    except UnicodeDecodeError:
        return None


def say_diff(old: str, new: str, names: tuple[str, str], context: int = 3) -> None:
    styles = {"+++": "bold", "---": "bold", "+": "green", "-": "red", "@": "cyan"}
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), *names, lineterm="", n=context):
        say(line, styles.get(line[:3], styles.get(line[:1])))


def cmd_diff(book: Book, n: int, code: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="steps-diff-") as tmp:
        before, after = two_stages(book, n, Path(tmp))
    for rel in sorted(before.keys() | after.keys()):
        a, b = before.get(rel), after.get(rel)
        old, new = as_text(a), as_text(b)
        if a == b or (code and is_prose(rel)):
            continue
        if old is None or new is None:
            what = "added" if a is None else "removed" if b is None else "changed"
            say(f"binary file {what}: {rel}", "bold")
            continue
        say_diff(old, new, (f"a/{rel}" if a is not None else "/dev/null",
                            f"b/{rel}" if b is not None else "/dev/null"))
    return 0


def cmd_bugs(book: Book, n: int) -> int:
    """Chapter n's planted bugs, each as the unified diff of its change to stage n."""
    bugs = book.registry.chapter(n).bugs
    if not bugs:
        say(f"chapter {n:02d} plants no bugs")
    for bug in bugs:
        old = stage_text(book, bug.file, n)
        say(f"bug {bug.name}, caught by {', '.join(bug.tests)}", "bold")
        say_diff(old, old.replace(bug.pattern, bug.replacement), (f"a/{bug.file}", f"b/{bug.file}"), 1)
    return 0


def cmd_tree(book: Book, n: int) -> int:
    with tempfile.TemporaryDirectory(prefix="steps-tree-") as tmp:
        before, after = two_stages(book, n, Path(tmp))
    marks = {rel: "new" if rel not in before else "changed" if before[rel] != data else ""
             for rel, data in after.items()}
    counts = [sum(m == kind for m in marks.values()) for kind in ("new", "changed", "")]
    say(f"stage {n:02d} ({book.registry.chapter(n).slug}): {counts[0]} new, {counts[1]} changed, "
        f"{counts[2]} unchanged", "bold")
    print_tree(marks, "", 0)
    return 0


def print_tree(marks: dict[str, str], prefix: str, depth: int) -> None:
    """The files under `prefix` with their marks; a folder with nothing new or changed is one line."""
    here = {rel[len(prefix):]: m for rel, m in marks.items() if rel.startswith(prefix)}
    for folder in sorted({r.split("/")[0] for r in here if "/" in r}):
        inside = [m for r, m in here.items() if r.startswith(folder + "/")]
        if any(inside):
            say(f"{'  ' * depth}{folder}/")
            print_tree(marks, f"{prefix}{folder}/", depth + 1)
        else:
            say(f"{'  ' * depth}{folder}/ ({len(inside)} file{'s' * (len(inside) != 1)}, unchanged)", "dim")
    for name in sorted(r for r in here if "/" not in r):
        say(f"{'  ' * depth}{name:<{max(40 - 2 * depth, len(name) + 1)}} {here[name]}".rstrip(),
            {"new": "green", "changed": "yellow"}.get(here[name]))
