# >>> ch17 file: the prefix cache
"""The prefix cache: a radix tree of token ids over the pages of the pool.

A path from the root spells a token sequence whose K and V some earlier request computed; its nodes hold
the pages that keep them. A new request whose prompt starts with a cached sequence takes those pages
instead of computing them again. Keys are whole pages: a node's key is a whole number of pages of
tokens, and its children are keyed by their first page. A page is shared whole or not at all (its slots
belong to one sequence), so the partial last page of a sequence is never cached.

    match_prefix  the longest cached prefix of a prompt, in whole pages, and the node where it ends
    insert        a sequence and its pages; returns how many of its first pages the tree already held
    lock/unlock   a running request keeps its path from eviction: lock counts go up to the root
    evict         free the pages of unlocked leaves, least recently used first, when the pool runs short

The tree owns the pages it holds. A running request that matched a prefix uses the tree's pages for it
(locked); its other pages are its own until it inserts them (`ModelRunner.cache_req`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from minioverlap.cache.allocator import PageAllocator


class Node:
    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None, parent: Node | None = None) -> None:
        self.key = key                   # its tokens, a whole number of pages
        self.pages = pages or []         # one page per page_size tokens of key
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}   # by each child's first page of tokens
        self.lock = 0                    # running requests whose prefix goes through it
        self.last_use = 0                # a clock tick: the least recently used leaf is evicted first


class RadixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        """An empty tree over the allocator's pages; the allocator comes to it (evict) when it runs short."""
        self.allocator, self.page_size = allocator, allocator.page_size
        allocator.reclaim = self.evict
        self.root = Node()
        self.root.lock = 1               # the root holds no page and is never evicted
        self.clock = itertools.count(1)
        self.cached_pages = 0            # pages the tree holds
        self.evictable_pages = 0         # of those, pages no running request locks

    def page(self, tokens: list[int] | tuple[int, ...], i: int) -> tuple[int, ...]:
        """Page i of a token sequence: a child's key in its parent."""
        return tuple(tokens[i * self.page_size:(i + 1) * self.page_size])

    def common_pages(self, node: Node, tokens: list[int], start: int) -> int:
        """How many whole pages of node's key equal tokens from page `start` on."""
        n = 0
        while n < len(node.pages) and self.page(node.key, n) == self.page(tokens, start + n) \
                and len(self.page(tokens, start + n)) == self.page_size:
            n += 1
        return n

    def walk(self, tokens: list[int]) -> Iterator[tuple[Node, int]]:
        """The nodes along tokens' cached prefix (a node that only starts it is split where it stops),
        each with the number of pages matched once it is passed."""
        node, matched = self.root, 0
        while (child := node.children.get(self.page(tokens, matched))) is not None:
            n = self.common_pages(child, tokens, matched)
            if n == 0:
                return
            node, matched = self.split(child, n) if n < len(child.pages) else child, matched + n
            node.last_use = next(self.clock)
            yield node, matched

    def match_prefix(self, tokens: list[int], drafter: bool = False) -> tuple[list[int], Node]:
        """The longest cached prefix of tokens[:-1] in whole pages -> its pages, and the node where it ends.
        The last token is never matched: the prefill must compute it, for its logits. With an MTP
        drafter the last matched page is left out too: the drafter's K and V at a position were computed
        from the token after it, and the token after the match may differ from the one the cache saw;
        one page earlier, that token lies inside the match."""
        # >>> exercise 17.1: match a prompt's cached prefix
        node, pages = self.root, []
        for node, _ in self.walk(tokens[:-1]):
            pages = pages + node.pages
        if drafter and pages:
            node = self.split(node, len(node.pages) - 1) if len(node.pages) > 1 else node.parent
            pages = pages[:-1]
        return pages, node
        # <<< exercise 17.1

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[int, list[int], Node]:
        """Cache tokens (a whole number of pages) with their pages -> how many of the first pages the tree
        held already (the caller's copies of those are duplicates), the tree's pages for all of tokens,
        and the node where they end."""
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(pages)} pages for {len(tokens)} tokens (page size {self.page_size})")
        node, held, path = self.root, 0, []
        for node, held in self.walk(tokens):
            path += node.pages
        if held < len(pages):
            child = Node(tuple(tokens[held * self.page_size:]), pages[held:], node)
            child.last_use = next(self.clock)
            node.children[self.page(child.key, 0)] = child
            self.cached_pages += len(child.pages)
            self.evictable_pages += len(child.pages)
            node, path = child, path + child.pages
        return held, path, node

    def split(self, node: Node, n: int) -> Node:
        """Cut node after its first n pages -> the new node holding them, now node's parent."""
        head = Node(node.key[:n * self.page_size], node.pages[:n], node.parent)
        head.lock, head.last_use = node.lock, node.last_use
        node.parent.children[self.page(head.key, 0)] = head
        node.key, node.pages, node.parent = node.key[n * self.page_size:], node.pages[n:], head
        head.children[self.page(node.key, 0)] = node
        return head

    def lock(self, node: Node) -> None:
        """A running request uses node's path: none of it may be evicted."""
        while node is not self.root:
            if node.lock == 0:
                self.evictable_pages -= len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> None:
        """Free at least num_pages pages (or all that are evictable): unlocked leaves, least recently used first."""
        leaves = [(n.last_use, id(n), n) for n in self.nodes() if not n.children and n.lock == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self.page(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))

    def nodes(self) -> Iterator[Node]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack += node.children.values()

    def problems(self, locked: list[Node]) -> list[str]:
        """What is wrong with the tree's account, given the nodes the running requests locked: each node's
        lock count is the number of them on or below it, and the page counts add up."""
        # >>> exercise 17.2: the tree's account
        expected: dict[int, int] = {}
        for node in locked:
            while node is not self.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        nodes = list(self.nodes())
        problems = [f"a cached node of {len(n.pages)} pages has lock {n.lock}, but {expected.get(id(n), 0)} "
                    f"running requests use it" for n in nodes if n.lock != expected.get(id(n), 0)]
        if self.cached_pages != sum(len(n.pages) for n in nodes):
            problems.append(f"the tree counts {self.cached_pages} pages but holds {sum(len(n.pages) for n in nodes)}")
        unlocked = sum(len(n.pages) for n in nodes if n.lock == 0)
        if self.evictable_pages != unlocked:
            problems.append(f"the tree counts {self.evictable_pages} evictable pages but {unlocked} are unlocked")
        return problems
        # <<< exercise 17.2

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [p for n in self.nodes() for p in n.pages]

    def path_pages(self, node: Node) -> list[int]:
        """The pages from the root to node, in order."""
        path = []
        while node is not self.root:
            path[:0] = node.pages
            node = node.parent
        return path
