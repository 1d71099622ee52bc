"""Figures and quotes in the chapters: a number the prose quotes from a recorded run
(chapters/figures/*.json, `<!-- fig: -->`) or from a transcript (`<!-- out: -->`), recomputed and
compared at its printed precision (tools/README.md: "Figures in the chapters").
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from pathlib import Path

from .markers import MarkerError
from .transcripts import NUMERAL, fences, transcripts

FIG = re.compile(r"<!-- fig: (?P<file>\S+) (?P<rows>rows: )?(?P<exprs>\S.*?) -->")
QUOTE = re.compile(r"<!-- out: (?P<texts>\S.*?) -->")
LOOKS_LIKE_CHECKED = re.compile(r"<!--\s*(output|fig|out)\b")
# a number as prose prints it, whole: 7, 0.375, 9,006, +9, -0.2, 2.4x (a sign only where no word or digit
# precedes it; no part of a word such as H200 or ch09)
NUMBER = re.compile(rf"(?<![\w.,]){NUMERAL}(?![\d.,]\d|\d)")
FIGURES = "chapters/figures"
FUNCTIONS = {"min": min, "max": max, "sum": lambda *v: sum(v), "abs": abs, "mean": lambda *v: sum(v) / len(v)}
OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Div: lambda a, b: a / b}


def number_value(text: str) -> tuple[float, int]:
    """A number as printed -> its value and its decimals: '9,006' -> (9006.0, 0), '−0.25' -> (-0.25, 2)."""
    text = text.replace(",", "").replace("−", "-")
    return float(text), len(text.partition(".")[2])


def agrees(printed: str, value: float) -> bool:
    """`printed` is `value` at its printed precision (a half-way value may round either way)."""
    shown, decimals = number_value(printed)
    return abs(value - shown) <= 0.5 * 10 ** -decimals * (1 + 1e-9)


class Many(list):
    """The items a filter selected, or one field of each: only min, max, sum and mean take them."""


def select(data, path: str, name: str):
    """Follow `name`, `.key`, `[key]` (a dict) and `[v, k=v, k^=v, k*=v, ...]` (a list's items with a field
    equal to v, field k equal to, starting with, containing v) in JSON data; a filter that matches several
    items gives Many."""
    here = data
    for key, field_ in re.findall(r"\[([^\]]*)\]|\.?([A-Za-z_]\w*)", path):
        if isinstance(here, Many):
            here = Many(select(item, f".{field_}" if field_ else f"[{key}]", name) for item in here)
        elif field_ or isinstance(here, dict):
            k = field_ or key.strip()
            if not isinstance(here, dict) or k not in here:
                keys = ", ".join(list(here)[:12]) if isinstance(here, dict) else type(here).__name__
                raise MarkerError(f"{name}: no {k!r} in {path} (there: {keys})")
            here = here[k]
        elif isinstance(here, list):
            terms = [t.strip() for t in key.split(",") if t.strip()]

            def fits(item, term: str) -> bool:
                m = re.fullmatch(r"(\w+)\s*([*^]?=)\s*(.*)", term)
                if not isinstance(item, dict):
                    return False
                if m is None:
                    return any(str(x) == term for x in item.values() if not isinstance(x, (dict, list)))
                got, how, want = str(item.get(m[1])), m[2], m[3]
                return got == want if how == "=" else got.startswith(want) if how == "^=" else want in got
            hits = [item for item in here if all(fits(item, t) for t in terms)]
            if not hits:
                raise MarkerError(f"{name}: nothing in {path} matches [{key}]")
            here = hits[0] if len(hits) == 1 else Many(hits)
        else:
            raise MarkerError(f"{name}: {path} goes into a {type(here).__name__}")
    return here


def figure_value(data, expr: str, name: str) -> float:
    """Evaluate a figure's expression over JSON data: paths into the data, numbers, + - * / and
    min, max, sum and mean (of several items, or of a recorded list of numbers) and abs. The paths are
    the names not followed by `(`."""
    values: dict[str, object] = {}

    def place(m: re.Match) -> str:
        if m.group(1) in FUNCTIONS and expr[m.end():].lstrip().startswith("("):
            return m.group(0)
        values[f"_v{len(values)}"] = select(data, m.group(0), name)
        return f"_v{len(values) - 1}"
    code = re.sub(r"(?<![\w.])([A-Za-z_]\w*)(?:\[[^\]]*\]|\.[A-Za-z_]\w*)*", place, expr)

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            value = values[node.id]
            if isinstance(value, list):     # several items selected, or a recorded list: number() checks each
                return Many(value)
            if type(value) not in (int, float):
                raise MarkerError(f"{name}: {expr} reads {value!r}, not a number")
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = number(ev(node.operand))
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](number(ev(node.left)), number(ev(node.right)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS \
                and not node.keywords:
            args = [ev(a) for a in node.args]
            return FUNCTIONS[node.func.id](*map(number, [v for a in args for v in (a if isinstance(a, Many) else [a])]))
        raise MarkerError(f"{name}: {expr}: only paths, numbers, + - * / and {', '.join(FUNCTIONS)}")

    def number(v) -> float:
        if isinstance(v, Many):
            raise MarkerError(f"{name}: {expr}: {len(v)} items selected where one number is meant")
        if type(v) not in (int, float):
            raise MarkerError(f"{name}: {expr} reads {v!r}, not a number")
        return v
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        raise MarkerError(f"{name}: cannot read {expr}: {e.msg}") from None
    return number(ev(tree))


def figure_errors(lines: list[str], tree: Path, rel: str) -> list[str]:
    """Every number a `<!-- fig: FILE EXPR[; EXPR...] -->` comment follows equals its expression over
    chapters/figures/FILE at the printed precision. A comment of n expressions covers the last n numbers
    before it on its line (after any comment before it on that line); `rows:` before the expressions, on
    a line of its own, covers each row of the table below it, `$1`, `$2`... standing for the row's cells."""
    errors, cache, code = [], {}, {i for start, end in fences(lines) for i in range(start, end + 1)}

    def load(name: str, where: str):
        if name not in cache:
            path = tree / FIGURES / name
            try:
                cache[name] = json.loads(path.read_text()) if path.is_file() else None
            except ValueError as e:
                raise MarkerError(f"{where}: {FIGURES}/{name} is not JSON: {e}") from None
        if cache[name] is None:
            raise MarkerError(f"{where}: no file {FIGURES}/{name}")
        return cache[name]

    def covered(text: str, exprs: list[str], file: str, where: str) -> None:
        numbers = NUMBER.findall(text)
        if len(numbers) < len(exprs):
            errors.append(f"{where}: {len(exprs)} expressions, but {len(numbers)} numbers before the comment")
            return
        data = load(file, where)
        for printed, expr in zip(numbers[len(numbers) - len(exprs):], exprs):
            value = figure_value(data, expr, where)
            if not agrees(printed, value):
                errors.append(f"{where}: {printed} is not {expr} = {value:.6g} ({file})")

    for i, line in enumerate(lines):
        if i in code or "<!--" not in line:
            continue
        start, where = 0, f"{rel}:{i + 1}"
        try:
            for m in re.finditer(r"<!--.*?-->", line):
                if m.group(0).startswith(("<!-- snippet:", "<!-- output")):
                    continue
                fig, quote = FIG.fullmatch(m.group(0)), QUOTE.fullmatch(m.group(0))
                if LOOKS_LIKE_CHECKED.match(m.group(0)) and not (fig or quote):
                    errors.append(f"{where}: not a figure or quote: `<!-- fig: FILE EXPR[; EXPR] -->`, "
                                  "`<!-- out: TEXT[; TEXT] -->`")
                if fig and fig["rows"]:
                    rows = [r for r in itertools.takewhile(lambda r: r.startswith("|"), lines[i + 1:])][2:]
                    if line.strip() != m.group(0) or not rows:
                        errors.append(f"{where}: a `rows:` figure stands alone on the line before a table")
                    for k, row in enumerate(rows):
                        cells = [c.strip() for c in row.strip().strip("|").split("|")]
                        exprs = re.sub(r"\$(\d+)", lambda c: cells[int(c.group(1)) - 1]
                                       if int(c.group(1)) <= len(cells) else c.group(0), fig["exprs"])
                        covered(row, [e.strip() for e in exprs.split(";")], fig["file"], f"{rel}:{i + k + 4}")
                elif fig:
                    covered(line[start:m.start()], [e.strip() for e in fig["exprs"].split(";")], fig["file"], where)
                start = m.end()
        except MarkerError as e:
            errors.append(str(e))
    return errors


def quote_errors(lines: list[str], rel: str) -> list[str]:
    """Every number a `<!-- out: TEXT[; TEXT...] -->` comment follows is, at its printed precision, the
    number at `~` in a line of the chapter's transcripts that TEXT matches (its spaces: any spaces)."""
    shown = [line for t in transcripts("\n".join(lines), rel)[0] for line in t.shown]
    code = {i for start, end in fences(lines) for i in range(start, end + 1)}
    errors = []
    for i, line in enumerate(lines):
        if i in code:
            continue
        start = 0
        for m in re.finditer(r"<!--.*?-->", line):
            quote, where = QUOTE.fullmatch(m.group(0)), f"{rel}:{i + 1}"
            if quote:
                texts = [t.strip() for t in quote["texts"].split(";")]
                numbers = NUMBER.findall(line[start:m.start()])[-len(texts):]
                if len(numbers) < len(texts) or any(t.count("~") != 1 for t in texts):
                    errors.append(f"{where}: a quote covers as many numbers before it as it has TEXTs, "
                                  "each with one `~` where the number is")
                    start = m.end()
                    continue
                for printed, text in zip(numbers, texts):
                    before, _, after = (re.sub(r"\s+", " ", p) for p in text.partition("~"))
                    pattern = re.compile(r" +".join(map(re.escape, before.split(" "))) + r" *"
                                         rf"({NUMERAL})"
                                         + r" *" + r" +".join(map(re.escape, after.split(" "))))
                    values = [m2.group(1) for s in shown for m2 in [pattern.search(s)] if m2]
                    if not values:
                        errors.append(f"{where}: no transcript line of this chapter reads `{text}`")
                    elif not any(agrees(printed, number_value(v)[0]) for v in values):
                        errors.append(f"{where}: {printed} is not what the transcript shows at `{text}`: "
                                      f"{', '.join(values)}")
            start = m.end()
    return errors
