# >>> ch17 file: the judge's own test of exercise 17.2
"""Exercise 17.2, judged on random trees: the check finds nothing wrong with an account that holds, and
finds each way an account can go wrong.

Each case builds a tree of random inserts and locks the paths of a few "running requests" the way the
engine does (a match, then a lock of the node where it ends; two requests may lock the same node). The
check must report nothing for it. Then one thing is broken at a time, and the check must report exactly
the problems that follow: one per node whose lock count disagrees with the requests that run through
it, one per counter of pages (cached, evictable) that disagrees with the nodes.

    python practice/judge.py test 17.2
"""

from __future__ import annotations

import random

import pytest

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.radix import Node, RadixCache

CASES = 40


def locked_tree(rng: random.Random) -> tuple[RadixCache, list[Node]]:
    """A random tree and the nodes its running requests locked (some more than once)."""
    size = rng.choice([1, 2, 4])
    tree = RadixCache(PageAllocator(512, size))
    seqs = []
    for _ in range(rng.randint(2, 8)):
        tokens = [rng.randint(0, 2) for _ in range(size * rng.randint(1, 6))]
        pages = tree.allocator.alloc(len(tokens) // size)
        held, _, _ = tree.insert(tokens, pages)
        tree.allocator.free(pages[:held])
        seqs.append(tokens)
    locked = []
    for _ in range(rng.randint(1, 5)):
        tokens = rng.choice(seqs)
        _, node = tree.match_prefix(tokens[:rng.randint(1, len(tokens))] + [0])
        if node is not tree.root:
            tree.lock(node)
            locked.append(node)
    if not locked:                                   # every case runs at least one request
        _, node = tree.match_prefix(seqs[0] + [0])
        tree.lock(node)
        locked.append(node)
    return tree, locked


def depth(tree: RadixCache, node: Node) -> int:
    n = 0
    while node is not tree.root:
        n, node = n + 1, node.parent
    return n


@pytest.fixture(params=range(CASES))
def case(request) -> tuple[RadixCache, list[Node]]:
    return locked_tree(random.Random(17200 + request.param))


def test_an_account_that_holds_has_no_problems(case):
    tree, locked = case
    assert tree.problems(locked) == []
    for node in locked:
        tree.unlock(node)
    assert tree.problems([]) == [], "every request gone, every lock count 0"


def test_a_lock_count_one_too_high_is_one_problem(case):
    tree, locked = case
    locked[0].lock += 1              # a node already locked: the evictable pages stay right
    assert len(tree.problems(locked)) == 1


def test_a_lock_that_did_not_go_up_to_the_root_is_a_problem_at_every_node_above(case):
    """A request that locked only its own node, not the path above it: each node above has one lock
    fewer than the requests that run through it."""
    tree, locked = case
    node = locked[0]
    tree.unlock(node)
    node.lock += 1                   # the node alone, as a lock that forgot its parents would
    if node.lock == 1:
        tree.evictable_pages -= len(node.pages)
    assert len(tree.problems(locked)) == depth(tree, node) - 1


def test_a_request_that_never_locked_its_path_is_a_problem_at_every_node_of_it(case):
    tree, locked = case
    node = locked[0]
    tree.unlock(node)
    assert len(tree.problems(locked)) == depth(tree, node)


def test_a_page_counter_that_disagrees_with_the_nodes_is_one_problem(case):
    tree, locked = case
    tree.cached_pages += 1
    assert len(tree.problems(locked)) == 1
    tree.cached_pages -= 1
    tree.evictable_pages -= 1
    assert len(tree.problems(locked)) == 1
    tree.cached_pages += 2
    assert len(tree.problems(locked)) == 2
