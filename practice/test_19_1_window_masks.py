# >>> ch19 file: the judge's own test of exercise 19.1
"""Exercise 19.1, judged on real grammars over the shipped tokenizer: a verify window's masks.

A constrained request's window is its bonus token's row and one row per draft. Row j must allow exactly
the tokens the grammar allows after the drafts d1..dj, which is what plain constrained decoding would mask
there if it had taken those drafts; a row after a draft the grammar forbids is left all ones (the row before
masks that draft, so the accept rule never reaches it). The matcher ends where it began: the scheduler
advances it by the tokens the step accepts, when the step is handled.

    python practice/judge.py test 19.1
"""

from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr

from minioverlap import LLM, SamplingParams
from minioverlap.constrained.grammar import Grammar

REGEX = r"(ab|cd)+[0-9]{2}"
SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def backend():
    llm = LLM(overlap=False)
    llm.processor.grammar(SamplingParams(regex="a"))          # the backend, made at the first grammar
    return llm.processor.grammars, llm.processor.tokenizer, llm.config.vocab_size


def grammar(backend, **params) -> Grammar:
    p = SamplingParams(**params)
    g = backend[0].grammar(p.grammar_kind, p.json_schema or p.regex)
    g.start()                                                   # its matcher, once compiled
    return g


def ids(backend, text: str) -> list[int]:
    return backend[1].encode(text).ids


def expected_rows(backend, params: dict, taken: list[int], drafts: list[int]) -> torch.Tensor:
    """The rows plain constrained decoding would mask: a fresh matcher over taken + d1..dj for row j, all
    ones after the first draft the grammar refuses."""
    rows = xgr.allocate_token_bitmask(len(drafts) + 1, backend[2])
    g = grammar(backend, **params)
    assert all(g.accept(t) for t in taken), f"the test's own tokens {taken} must be ones the grammar takes"
    for j in range(len(drafts) + 1):
        g.matcher.fill_next_token_bitmask(rows, j)
        if j == len(drafts) or not g.accept(drafts[j]) or g.is_terminated():
            break
    return rows


def window(backend, params: dict, taken: list[int], drafts: list[int]) -> tuple[torch.Tensor, Grammar]:
    g = grammar(backend, **params)
    assert all(g.accept(t) for t in taken), f"the test's own tokens {taken} must be ones the grammar takes"
    rows = xgr.allocate_token_bitmask(len(drafts) + 1, backend[2])
    g.fill_window(rows, drafts)
    return rows, g


def describe(rows: torch.Tensor) -> list[str]:
    """Each row of a bitmask as the learner reads it: untouched (all ones), or how many tokens it allows."""
    bits = (rows.unsqueeze(-1) >> torch.arange(32, dtype=rows.dtype)) & 1
    allowed = bits.sum(dim=(-1, -2)).tolist()
    return ["all ones (never filled)" if bool((row == -1).all()) else f"a mask allowing {n} tokens"
            for row, n in zip(rows, allowed)]


def differ(rows: torch.Tensor, want: torch.Tensor, drafts: list[int]) -> str:
    """What the window's rows got wrong, row by row, against plain constrained decoding's masks."""
    got, expected = describe(rows), describe(want)
    wrong = [j for j in range(len(want)) if not torch.equal(rows[j], want[j])]
    return (f"{len(wrong)} of the window's {len(want)} rows differ from the masks plain constrained decoding "
            f"gives after the drafts {drafts} (row j: after d1..dj): "
            + "; ".join(f"row {j}: expected {expected[j]}, got {got[j]}"
                        + (" (as many, but other tokens)" if got[j] == expected[j] else "") for j in wrong))


@pytest.mark.parametrize("text", ["abcd42", "ab", "abab9"])
def test_drafts_the_grammar_takes_give_each_row_its_mask(backend, text):
    """Every draft is one the grammar takes: row j is the mask after d1..dj, for each j."""
    drafts = ids(backend, text)
    rows, _ = window(backend, dict(regex=REGEX), [], drafts)
    want = expected_rows(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, want), differ(rows, want, drafts)


def test_rows_after_a_draft_the_grammar_refuses_stay_all_ones(backend):
    """The second draft breaks the grammar: rows 0 and 1 are masks, every row after is all ones."""
    drafts = ids(backend, "ab") + ids(backend, "zz") + ids(backend, "cd")
    rows, _ = window(backend, dict(regex=REGEX), [], drafts)
    want = expected_rows(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, want), differ(rows, want, drafts)
    refused = len(ids(backend, "ab"))                          # the index of "zz" among the drafts
    assert (rows[refused + 1:] == -1).all(), (f"draft {refused} is one the grammar refuses: the rows after it "
                                              f"must stay all ones, got {describe(rows)[refused + 1:]}")
    assert not (rows[refused] == -1).all(), f"row {refused} must mask the refused draft, got {describe(rows)[refused]}"


def test_the_matcher_ends_where_it_began(backend):
    """After the window, the matcher takes exactly what it took before: the tokens the step will accept."""
    taken, drafts = ids(backend, "ab"), ids(backend, "cd12")
    _, g = window(backend, dict(regex=REGEX), taken, drafts)
    fresh = grammar(backend, regex=REGEX)
    assert all(fresh.accept(t) for t in taken), f"the test's own tokens {taken} must be ones the grammar takes"
    a, b = (xgr.allocate_token_bitmask(1, backend[2]) for _ in range(2))
    g.matcher.fill_next_token_bitmask(a, 0)
    fresh.matcher.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b), (f"after the window the matcher must be where it began, after {taken}: its next "
                               f"mask should be {describe(b)[0]}, got {describe(a)[0]} (roll back every draft "
                               f"it accepted)")
    assert g.accept(ids(backend, "x")[0]) is False, "after the window the matcher took a token its grammar refuses"
    assert g.accept(drafts[0]) is True, (f"after the window the matcher refused the first draft {drafts[0]}, which "
                                         f"the grammar takes after {taken}: it is not where it began")


def test_a_draft_that_ends_the_grammar_ends_the_window(backend):
    """A draft that is the grammar's stop token ends it: no row after it is filled, and the matcher is
    back where it began (not terminated)."""
    drafts = ids(backend, "ab12") + [0, 0]                       # 0: the tiny model's EOS
    rows, g = window(backend, dict(regex=REGEX), [], drafts)
    want = expected_rows(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, want), differ(rows, want, drafts)
    assert not g.is_terminated(), ("after the window the matcher is terminated: the stop token it accepted "
                                   "as a draft must be rolled back like any other draft")


def test_random_windows_over_a_json_schema(backend):
    """Windows of random drafts, some the grammar takes and some not, after a random start."""
    text = '{"n": 12345}'
    rng = random.Random(0)
    tokens = ids(backend, text)
    for _ in range(20):
        start = rng.randrange(len(tokens))
        drafts = tokens[start:start + rng.randrange(1, 5)]
        if rng.random() < 0.5:
            drafts = drafts[:-1] + [rng.randrange(backend[2])]
        params = dict(json_schema=SCHEMA)
        rows, _ = window(backend, params, tokens[:start], drafts)
        want = expected_rows(backend, params, tokens[:start], drafts)
        assert torch.equal(rows, want), f"after the tokens {tokens[:start]}: " + differ(rows, want, drafts)
