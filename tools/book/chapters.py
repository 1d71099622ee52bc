"""The chapters' text: snippets (code shown by reference, compared with the stage's source), and the
`snippets` and `outputs` commands, which check every chapter's snippets, figures and quotes, and
transcripts.
"""

from __future__ import annotations

import ast
import difflib
import re
import tempfile
import textwrap
from pathlib import Path

from .figures import FIG, QUOTE, figure_errors, quote_errors
from .markers import MarkerError
from .registry import parse_chapters
from .report import say
from .stages import NAMED, Book, _build, stage_text
from .transcripts import check_transcripts, transcripts

SNIPPET = re.compile(r"^<!-- snippet: (?P<ref>\S+)(?: stub (?P<stub>\d+\.\d+))? -->\s*$")


def snippet_source(stage: Path, ref: str, text: str | None = None) -> list[str]:
    """The lines that `path`, `path::Name` or `path::Class.method` names in a stage: exact source,
    decorators included, methods dedented; `text` is the file's text where it is not the stage's (a stub)."""
    rel, _, name = ref.partition("::")
    if text is None and not (Path(stage) / rel).is_file():
        raise MarkerError(f"{rel} is not in the stage")
    lines = (Path(stage) / rel).read_text().splitlines() if text is None else text.splitlines()
    if not name:
        return lines
    body: list[ast.stmt] = ast.parse("\n".join(lines)).body
    for part in name.split("."):
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next((n for n in body if isinstance(n, defs) and n.name == part), None)
        if node is None:
            raise MarkerError(f"{rel} has no {name} in the stage")
        body = node.body
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return textwrap.dedent("\n".join(lines[start - 1:node.end_lineno])).splitlines()


def stub_text(book: Book, rel: str, chapter: int, exercise: str) -> str:
    """A file of stage `chapter` with exercise `exercise`'s region as the learner gets it: the stub."""
    if rel not in book.sources:
        raise MarkerError(f"{rel} is not in the stage")
    stubbed: set[str] = set()
    text = stage_text(book, rel, chapter, stub=exercise, stubbed=stubbed)
    if exercise not in stubbed:
        raise MarkerError(f"{rel} holds no region of exercise {exercise} in the stage")
    return text


def check_markdown(md: Path, stage: Path, rel: str, book: Book | None = None,
                   chapter: int | None = None) -> tuple[list[str], str]:
    """Compare every snippet block of one chapter with its stage, every figure with its recorded run and
    every quote with the chapter's transcripts (and read the transcripts' markers, which
    check_transcripts runs); returns (errors, the text with the snippets repaired). A snippet
    `REF stub NN.K` shows exercise NN.K's stub, the contract without the answer (it needs `book`)."""
    lines, errors, out, i = md.read_text().splitlines(), [], [], 0
    while i < len(lines):
        out.append(lines[i])
        m, i = SNIPPET.match(lines[i]), i + 1
        if not m:
            continue
        where = f"{rel}:{i}: snippet {m['ref']}"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None or not re.match(r"```(python|py)\s*$", lines[i]):
            errors.append(f"{where}: must be followed at once by a complete ```python block")
            continue
        shown = lines[i + 1:end]
        try:
            if m["stub"] and book is None:
                raise MarkerError("a stub snippet needs the book's source")
            text = stub_text(book, m["ref"].partition("::")[0], chapter, m["stub"]) if m["stub"] else None
            source = snippet_source(stage, m["ref"], text)
        except (MarkerError, SyntaxError) as e:
            errors.append(f"{where}: {e}")
            source = shown
        if shown != source:
            diff = list(difflib.unified_diff(shown, source, "chapter", "stage", lineterm="", n=1))
            errors.append(f"{where}: drifted from the stage's source\n" + "\n".join(diff[2:14]))
        out += [lines[i], *source]
        i = end
    errors += transcripts("\n".join(lines), rel)[1] + figure_errors(lines, stage, rel) + quote_errors(lines, rel)
    return errors, "\n".join(out) + "\n"


def chapter_markdowns(book: Book) -> list[tuple[str, int]]:
    """chapters/NN-*.md with their chapter numbers."""
    return [(rel, n) for rel, n in book.files.items()
            if rel.startswith("chapters/") and NAMED["chapters"].match(rel.rsplit("/", 1)[-1])]


def cmd_snippets(book: Book, write: bool) -> int:
    count, figures, wrong = 0, 0, 0
    with tempfile.TemporaryDirectory(prefix="steps-snippets-") as tmp:
        for rel, n in chapter_markdowns(book):
            stage, path = _build(book, n, Path(tmp) / f"ch{n:02d}"), book.root / rel
            errors, fixed = check_markdown(path, stage, rel, book, n)
            if write and fixed != path.read_text():
                path.write_text(fixed)
                say(f"rewrote {rel}", "yellow")
                errors, _ = check_markdown(path, stage, rel, book, n)
            count += sum(bool(SNIPPET.match(line)) for line in fixed.splitlines())
            figures += sum(len(FIG.findall(line)) + len(QUOTE.findall(line)) for line in fixed.splitlines())
            wrong += len(errors)
            for error in errors:
                say(error, "red")
    print(f"{count} snippets, {figures} figures and quotes, {wrong} wrong")
    return 1 if wrong else 0


def cmd_outputs(book: Book, chapters: str | None, timeout: float) -> int:
    """Every transcript of the chapters, run in the final tree (the book's root, as a reader runs it):
    no stage is built. `check` compares them in each chapter's stage too."""
    count, wrong = 0, 0
    wanted = set(parse_chapters(chapters, book.registry.numbers))
    for rel, n in chapter_markdowns(book):
        if n in wanted:
            errors = check_transcripts(book.root / rel, book.root, rel, final=True, timeout=timeout)
            count += len(transcripts((book.root / rel).read_text(), rel)[0])
            wrong += len(errors)
            for error in errors:
                say(error, "red")
    print(f"{count} transcripts, {wrong} wrong")
    return 1 if wrong else 0
