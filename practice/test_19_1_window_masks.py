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
    llm.processor.grammar(SamplingParams(regex="a"))          # the compiler, made at the first grammar
    return llm.processor.grammars, llm.processor.tokenizer, llm.config.vocab_size


def grammar(backend, **params) -> Grammar:
    return backend[0].grammar(SamplingParams(**params))


def ids(backend, text: str) -> list[int]:
    return backend[1].encode(text).ids


def expected_rows(backend, params: dict, taken: list[int], drafts: list[int]) -> torch.Tensor:
    """The rows plain constrained decoding would mask: a fresh matcher over taken + d1..dj for row j, all
    ones after the first draft the grammar refuses."""
    rows = xgr.allocate_token_bitmask(len(drafts) + 1, backend[2])
    g = grammar(backend, **params)
    assert all(g.accept(t) for t in taken)
    for j in range(len(drafts) + 1):
        g.matcher.fill_next_token_bitmask(rows, j)
        if j == len(drafts) or not g.accept(drafts[j]) or g.is_terminated():
            break
    return rows


def window(backend, params: dict, taken: list[int], drafts: list[int]) -> tuple[torch.Tensor, Grammar]:
    g = grammar(backend, **params)
    assert all(g.accept(t) for t in taken)
    rows = xgr.allocate_token_bitmask(len(drafts) + 1, backend[2])
    g.fill_window(rows, drafts)
    return rows, g


@pytest.mark.parametrize("text", ["abcd42", "ab", "abab9"])
def test_drafts_the_grammar_takes_give_each_row_its_mask(backend, text):
    """Every draft is one the grammar takes: row j is the mask after d1..dj, for each j."""
    drafts = ids(backend, text)
    rows, _ = window(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, expected_rows(backend, dict(regex=REGEX), [], drafts))


def test_rows_after_a_draft_the_grammar_refuses_stay_all_ones(backend):
    """The second draft breaks the grammar: rows 0 and 1 are masks, every row after is all ones."""
    drafts = ids(backend, "ab") + ids(backend, "zz") + ids(backend, "cd")
    rows, _ = window(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, expected_rows(backend, dict(regex=REGEX), [], drafts))
    refused = len(ids(backend, "ab"))                          # the index of "zz" among the drafts
    assert (rows[refused + 1:] == -1).all() and not (rows[refused] == -1).all()


def test_the_matcher_ends_where_it_began(backend):
    """After the window, the matcher takes exactly what it took before: the tokens the step will accept."""
    taken, drafts = ids(backend, "ab"), ids(backend, "cd12")
    _, g = window(backend, dict(regex=REGEX), taken, drafts)
    fresh = grammar(backend, regex=REGEX)
    assert all(fresh.accept(t) for t in taken)
    a, b = (xgr.allocate_token_bitmask(1, backend[2]) for _ in range(2))
    g.matcher.fill_next_token_bitmask(a, 0)
    fresh.matcher.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b)
    assert g.accept(ids(backend, "x")[0]) is False and g.accept(drafts[0]) is True


def test_a_draft_that_ends_the_grammar_ends_the_window(backend):
    """A draft that is the grammar's stop token ends it: no row after it is filled, and the matcher is
    back where it began (not terminated)."""
    drafts = ids(backend, "ab12") + [0, 0]                       # 0: the tiny model's EOS
    rows, g = window(backend, dict(regex=REGEX), [], drafts)
    assert torch.equal(rows, expected_rows(backend, dict(regex=REGEX), [], drafts))
    assert not g.is_terminated()


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
        assert torch.equal(rows, expected_rows(backend, params, tokens[:start], drafts)), (start, drafts)
