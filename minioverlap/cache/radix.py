# >>> ch17 file: the prefix cache
"""The prefix cache: a radix tree of token ids over the pages of the pool.

A path from the root spells a token sequence whose K and V some earlier request computed; its nodes hold
the pages that keep them. A new request whose prompt starts with a cached sequence takes those pages
instead of computing them again. The tree's key of a sequence has one entry per position (the cache
manager makes it, manager.py's token_key: the token, or bigram_key with an MTP drafter: the token and
the next one). Keys are whole pages: a node's key is a whole number of pages of entries, and its
children are keyed by their first page. A page is shared whole or not at all (its slots belong to one
sequence), so the partial last page of a sequence is never cached.

    match_prefix  the longest cached prefix of a key, in whole pages, and the node where it ends
    insert        a key and its pages; returns how many of its first pages the tree already held
    lock/unlock   a running request keeps its path from eviction: lock counts go up to the root
    evict         free the pages of unlocked leaves, least recently used first, when the pool runs short

The tree owns the pages it holds. A running request that matched a prefix uses the tree's pages for it
(locked); its other pages are its own until it inserts them (`CacheManager.cache_req`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from minioverlap.cache.allocator import PageAllocator


class Node:
    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None, parent: Node | None = None) -> None:
        self.key = key                   # its entries (tokens), a whole number of pages
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

    def page(self, key: list | tuple, i: int) -> tuple:
        """Page i of a key: a child's key in its parent."""
        return tuple(key[i * self.page_size:(i + 1) * self.page_size])

    def common_pages(self, node: Node, key: list, start: int) -> int:
        """How many whole pages of node's key equal key's from page `start` on."""
        n = 0
        while n < len(node.pages) and self.page(node.key, n) == self.page(key, start + n):
            n += 1
        return n

    def match_prefix(self, key: list) -> tuple[list[int], Node]:
        """The longest cached prefix of key in whole pages -> its pages, and the node where it ends. A
        node that the key leaves in the middle is split there, so that a node ends where the match
        does; every node passed is marked used now."""
        # >>> exercise 17.1: match a key's cached prefix
        node, pages = self.root, []
        while (child := node.children.get(self.page(key, len(pages)))) is not None:
            n = self.common_pages(child, key, len(pages))
            node = self.split(child, n) if n < len(child.pages) else child
            node.last_use = next(self.clock)
            pages = pages + node.pages
        return pages, node
        # <<< exercise 17.1

    def insert(self, key: list, pages: list[int]) -> tuple[int, list[int], Node]:
        """Cache key (a whole number of pages) with its pages -> how many of the first pages the tree held
        already (the caller's copies of those are duplicates), the tree's pages for all of key, and the
        node where they end."""
        if len(key) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(pages)} pages for a key of {len(key)} (page size {self.page_size})")
        path, node = self.match_prefix(key)
        held = len(path)
        if held < len(pages):
            child = Node(tuple(key[held * self.page_size:]), pages[held:], node)
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
