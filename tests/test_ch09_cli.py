"""Chapter 09 on the command line: `minioverlap generate --mtp K`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import spec_overlap


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def fibonacci(n):", "--max-tokens", "24",
                           *args], capture_output=True, text=True, timeout=300)


@pytest.mark.process
def test_generate_mtp_prints_the_plain_text_and_the_accept_length():
    """`--mtp 3` (without --loop: the normal loop) streams exactly the plain greedy completion, then the
    accept length: tokens / passes (the prefill and the verify steps), each pass at least one token and at
    most k+1."""
    mtp, plain = generate("--mtp", "3"), generate("--loop", "normal")
    assert [mtp.returncode, plain.returncode] == [0, 0], mtp.stderr + plain.stderr
    assert mtp.stdout.startswith(plain.stdout) and "(24 tokens, finish_reason=length)" in plain.stdout
    extra = mtp.stdout[len(plain.stdout):]
    m = re.fullmatch(r"accept length (\d+\.\d\d) \((\d+) tokens in (\d+) passes: the prefill and (\d+) verify "
                     r"steps\)\n", extra)
    assert m, extra
    length, tokens, passes, verifies = float(m[1]), int(m[2]), int(m[3]), int(m[4])
    assert tokens == 24 and 24 / 4 <= passes <= 24 and verifies == passes - 1 and m[1] == f"{tokens / passes:.2f}"
    assert length > 1.5                          # the tiny model's MTP layer drafts well on code


@pytest.mark.process
def test_generate_mtp_refuses_the_overlap_loop():
    """MTP runs in the normal loop until chapter 12: `--loop overlap --mtp 3` is a clear error, not a traceback."""
    if spec_overlap():
        pytest.skip("from chapter 12 the overlap loop runs MTP (tests/test_ch12_spec_overlap.py)")
    bad = generate("--loop", "overlap", "--mtp", "3")
    assert bad.returncode == 2 and "--mtp" in bad.stderr and "--loop overlap" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""
