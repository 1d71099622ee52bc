# >>> ch17 file: the judge's own test of exercise 17.1
"""Exercise 17.1, judged on random trees against a table kept beside them.

Each case inserts random token sequences (whole pages, a vocabulary of three tokens, so that they share
prefixes of every length) into a tree of page size 1, 2 or 4, and keeps, beside it, the page that first
cached each prefix of whole pages. Then it matches keys (prefixes of what was inserted, the same with a
token more or less, and random ones), and requires of each match: the pages the table gives for the
longest cached prefix of the key, in whole pages; a node whose path from the root holds exactly those
pages; that node locked, lock counts and page counters that hold; the tree unchanged in what it caches;
and every node the match passed marked used now, so that eviction keeps the prefixes requests match.

    python practice/judge.py test 17.1
"""

from __future__ import annotations

import random

import pytest

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.radix import Node, RadixCache

CASES = 60


def expected_pages(first: dict[tuple[int, ...], int], tokens: list[int], size: int) -> list[int]:
    """The table's pages for the longest cached prefix of the key, in whole pages."""
    pages: list[int] = []
    while (len(pages) + 1) * size <= len(tokens) and tuple(tokens[:(len(pages) + 1) * size]) in first:
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


def account(tree: RadixCache, locked: Node) -> list[str]:
    """What disagrees when one request locked `locked` (the root: none): each node on its path has lock 1,
    every other node 0, and the page counters add up."""
    path = set()
    while locked is not tree.root:
        path.add(id(locked))
        locked = locked.parent
    nodes = list(tree.nodes())
    wrong = [f"a node of pages {n.pages} has lock {n.lock}, not {int(id(n) in path)}"
             for n in nodes if n.lock != int(id(n) in path)]
    if tree.cached_pages != sum(len(n.pages) for n in nodes):
        wrong.append(f"cached_pages is {tree.cached_pages}, the nodes hold {sum(len(n.pages) for n in nodes)}")
    if tree.evictable_pages != sum(len(n.pages) for n in nodes if n.lock == 0):
        wrong.append(f"evictable_pages is {tree.evictable_pages}, the unlocked nodes hold "
                     f"{sum(len(n.pages) for n in nodes if n.lock == 0)}")
    return wrong


def prompts(rng: random.Random, seqs: list[list[int]]) -> list[list[int]]:
    """Each sequence whole, cut anywhere, with a token more; and random prompts."""
    out = []
    for tokens in seqs:
        cut = rng.randint(1, len(tokens))
        out += [tokens, tokens[:cut], tokens + [rng.randint(0, 2)], tokens[:cut] + [rng.randint(0, 2)] * 3]
    out += [[rng.randint(0, 2) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    return out


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_match_is_the_longest_cached_prefix_in_whole_pages(size):
    rng = random.Random(1700 + size)
    for case in range(CASES):
        tree, first, seqs = build(rng, size)
        cached = sorted(tree.pages())
        for tokens in prompts(rng, seqs):
            want = expected_pages(first, tokens, size)
            pages, node = tree.match_prefix(tokens)
            where = f"case {case}, page size {size}, prompt {tokens}"
            assert pages == want, f"{where}: matched pages {pages}, the cached prefix's are {want}"
            assert tree.path_pages(node) == pages, f"{where}: the node's path holds {tree.path_pages(node)}, not {pages}"
            assert sorted(tree.pages()) == cached, f"{where}: a match changed what the tree caches"
            tree.lock(node)
            assert not (wrong := account(tree, node)), f"{where}: locking the node breaks the account: {wrong}"
            tree.unlock(node)
            assert not (wrong := account(tree, tree.root)), f"{where}: {wrong}"


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_match_marks_every_node_it_passes_used_now(size):
    """After a match, each node from the root to the one where it ends has a last_use later than any
    node had before the match: eviction takes the least recently used leaves first."""
    rng = random.Random(1710 + size)
    for case in range(CASES):
        tree, _, seqs = build(rng, size)
        for tokens in prompts(rng, seqs):
            before = max(n.last_use for n in tree.nodes())
            _, node = tree.match_prefix(tokens)
            path = []
            while node is not tree.root:
                path.append(node)
                node = node.parent
            stale = [n.last_use for n in reversed(path) if n.last_use <= before]
            assert not stale, (f"case {case}, page size {size}, prompt {tokens}: the match passed {len(path)} "
                               f"nodes, and {len(stale)} of them kept an old last_use {stale} (the tree's clock "
                               f"was past {before}): a match marks every node it passes used now")


def test_eviction_keeps_the_prefix_matched_last():
    """Two prompts cached, the first one matched again: when the pool runs short, the other one goes."""
    tree = RadixCache(PageAllocator(16, 2))
    first, second = tree.allocator.alloc(2), tree.allocator.alloc(2)
    tree.insert([1, 1, 2, 2], first)
    tree.insert([3, 3, 4, 4], second)
    tree.match_prefix([1, 1, 2, 2, 0])                   # the first prompt's prefix, used again
    tree.evict(2)
    kept = tree.match_prefix([1, 1, 2, 2, 0])[0], tree.match_prefix([3, 3, 4, 4, 0])[0]
    assert kept == (first, []), (f"after evicting 2 pages the tree keeps {kept[0]} of the prefix matched last "
                                 f"(want {first}) and {kept[1]} of the one cached after it (want []): the "
                                 f"prefix matched last must be the last evicted")


def test_a_key_that_leaves_a_node_in_the_middle_splits_it_there():
    """A node of three pages, matched for two: the match ends at a node of its own (the first two
    pages), whose child holds the third; a partial page at the end of the key is never matched."""
    tree = RadixCache(PageAllocator(16, 4))
    pages = tree.allocator.alloc(3)
    tree.insert(list(range(12)), pages)
    matched, node = tree.match_prefix(list(range(8)) + [0, 0])
    assert matched == pages[:2] and node.pages == pages[:2] and tree.path_pages(node) == pages[:2], (
        f"a key that agrees with the first 2 of a node's 3 pages {pages}: matched {matched}, ending at a node of "
        f"pages {node.pages}; want {pages[:2]}, at a node of its own holding them (split the node there)")
    assert [child.pages for child in node.children.values()] == [pages[2:]], (
        f"the split node's children hold {[child.pages for child in node.children.values()]}, want [{pages[2:]}]")
    assert tree.match_prefix(list(range(11)))[0] == pages[:2], "a partial last page is never matched"
    assert tree.match_prefix(list(range(12)))[0] == pages, "the whole key matches all 3 pages, across the split"
