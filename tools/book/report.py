"""What the commands print: `say` (coloured by rich where it is installed) and `check`'s Report, one line
per check and the closing line `N passed, N failed`.
"""

from __future__ import annotations

import textwrap
import time

try:  # rich only colours the output; the text is the same without it
    from rich.console import Console
    from rich.text import Text
    _console: Console | None = Console(highlight=False, soft_wrap=True)
except ImportError:
    _console = None


def say(text: str, style: str | None = None) -> None:
    if _console is None:
        print(text, flush=True)
    else:
        _console.print(Text(text, style=style or ""))


class Report:
    """One line per check as it finishes, with its wall time (the time since the line before: checks
    run one after another); the total, then the closing line that counts them."""

    def __init__(self) -> None:
        self.passed = self.failed = 0
        self.ok: set[str] = set()           # the names of the checks that passed
        self.start = self.last = time.monotonic()

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.passed, self.failed = self.passed + ok, self.failed + (not ok)
        if ok:
            self.ok.add(name)
        now, summary = time.monotonic(), detail.partition("\n")[0] if ok else ""
        seconds, self.last = now - self.last, now
        say(f"{name:<32} {'pass' if ok else 'FAIL'} {seconds:7.1f} s  {summary}".rstrip(),
            "green" if ok else "bold red")
        if detail and not ok:
            say(textwrap.indent(detail, "    | "), "red")

    def close(self) -> int:
        print(f"total {time.monotonic() - self.start:.1f} s", flush=True)
        print(f"{self.passed} passed, {self.failed} failed", flush=True)
        return 1 if self.failed else 0
