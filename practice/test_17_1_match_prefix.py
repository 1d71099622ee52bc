# >>> ch17 file: the judge's own test of exercise 17.1
"""Exercise 17.1, judged on random trees against a table kept beside them.

Each case inserts random token sequences (whole pages, a vocabulary of three tokens, so that they share
prefixes of every length) into a tree of page size 1, 2 or 4, and keeps, beside it, the page that first
cached each prefix of whole pages. Then it matches prompts (prefixes of what was inserted, the same with
a token more or less, and random ones), with and without the drafter, and requires of each match: the
pages the table gives for the longest cached prefix of the prompt without its last token, in whole
pages (one page fewer with the drafter); a node whose path from the root holds exactly those pages;
that node locked, an account that holds; and the tree unchanged in what it caches.

    python practice/judge.py test 17.1
"""

from __future__ import annotations

import random

import pytest

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.radix import RadixCache

CASES = 60


def expected_pages(first: dict[tuple[int, ...], int], tokens: list[int], size: int) -> list[int]:
    """The table's pages for the longest cached prefix of tokens[:-1], in whole pages."""
    pages: list[int] = []
    while (len(pages) + 1) * size <= len(tokens) - 1 and tuple(tokens[:(len(pages) + 1) * size]) in first:
        pages.append(first[tuple(tokens[:(len(pages) + 1) * size])])
    return pages


def build(rng: random.Random, size: int) -> tuple[RadixCache, dict[tuple[int, ...], int], list[list[int]]]:
    """A tree of random inserts; the table of the page that first cached each prefix; the sequences."""
    tree = RadixCache(PageAllocator(256, size))
    first: dict[tuple[int, ...], int] = {}
    seqs = []
    for _ in range(rng.randint(1, 8)):
        tokens = [rng.randint(0, 2) for _ in range(size * rng.randint(1, 6))]
        pages = tree.allocator.alloc(len(tokens) // size)
        held, _, _ = tree.insert(tokens, pages)
        tree.allocator.free(pages[:held])                  # the caller's copies of pages the tree held
        for j, page in enumerate(pages, 1):
            first.setdefault(tuple(tokens[:j * size]), page)
        seqs.append(tokens)
    return tree, first, seqs


def prompts(rng: random.Random, seqs: list[list[int]]) -> list[list[int]]:
    """Each sequence whole, cut anywhere, with a token more; and random prompts."""
    out = []
    for tokens in seqs:
        cut = rng.randint(1, len(tokens))
        out += [tokens, tokens[:cut], tokens + [rng.randint(0, 2)], tokens[:cut] + [rng.randint(0, 2)] * 3]
    out += [[rng.randint(0, 2) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    return out


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("drafter", [False, True], ids=["target", "drafter"])
def test_a_match_is_the_longest_cached_prefix_in_whole_pages_without_the_last_token(size, drafter):
    rng = random.Random(1700 + size)
    for case in range(CASES):
        tree, first, seqs = build(rng, size)
        cached = sorted(tree.pages())
        for tokens in prompts(rng, seqs):
            want = expected_pages(first, tokens, size)
            if drafter:
                want = want[:-1]
            pages, node = tree.match_prefix(tokens, drafter)
            where = f"case {case}, page size {size}, prompt {tokens}"
            assert pages == want, f"{where}: matched pages {pages}, the cached prefix's are {want}"
            assert tree.path_pages(node) == pages, f"{where}: the node's path holds {tree.path_pages(node)}, not {pages}"
            assert sorted(tree.pages()) == cached, f"{where}: a match changed what the tree caches"
            tree.lock(node)
            assert tree.problems([node]) == [], f"{where}: locking the node breaks the account: {tree.problems([node])}"
            tree.unlock(node)
            assert tree.problems([]) == [], f"{where}: {tree.problems([])}"


def test_a_prompt_seen_whole_leaves_its_last_token_to_compute():
    """A prompt of exactly two cached pages matches one page: its last token is never served from the
    cache, and the page that holds it is computed again (the prefill needs that token's logits)."""
    tree = RadixCache(PageAllocator(16, 4))
    pages = tree.allocator.alloc(2)
    tree.insert(list(range(8)), pages)
    assert tree.match_prefix(list(range(8)))[0] == pages[:1]
    assert tree.match_prefix(list(range(9)))[0] == pages
    assert tree.match_prefix(list(range(9)), drafter=True)[0] == pages[:1]
    assert tree.match_prefix(list(range(8)), drafter=True) == ([], tree.root)
