# >>> ch02 file: the cache manager
# >>> ch17 replaces ch02: with the tree's verbs
#| """The cache manager: the one account of who holds each page and request slot.
#|
#| A request takes a request slot (its row of the tables) when it is admitted and gives it back, with its
#| pages, when it leaves; a step's batch takes the request's new pages from the allocator as it lays them
#| out (engine/forward_batch.py). The runner asks the manager, not the allocator, for a request's slot
#| and pages, and for the pages a request may still be given:
#|
#|     admit / release     a request's slot; its pages once it leaves
#|     available_size      the pages a request may still be given
#|     integrity_problems  every page and slot free or held once, each row pointing at its pages (04)
#|
#| The manager is in the cache layer, below the engine where the request (Req) lives: it reads and writes
#| what the cache knows of a request, `CachedReq`, a protocol that Req fulfils.
#| """
"""The cache manager: the one account of who holds each page and request slot.

A request takes a request slot (its row of the tables) when it is admitted and gives it back, with its
pages, when it leaves; a step's batch takes the request's new pages from the allocator as it lays them
out (engine/forward_batch.py). The runner and the scheduler ask the manager, never the allocator or
the tree, for a request's slot and pages, and for the pages a request may still be given:

    admit / release     a request's slot; its pages once it leaves (a finished one's go into the tree)
    available_size      the pages a request may still be given: the free ones and the evictable ones
    integrity_problems  every page and slot free or held once, each row pointing at its pages (04)

From chapter 17 it keeps what requests computed in a radix tree over the pool (radix.py), the tree's
verbs behind its own:

    match_req           the longest cached prefix of a prompt: its pages, locked for the request
    cache_req           what handled steps computed into the tree (SGLang's cache_unfinished_req; a
                        request that leaves is cached by release, as cache_finished_req does)

The manager is in the cache layer, below the engine where the request (Req) lives: it reads and writes
what the cache knows of a request, `CachedReq`, a protocol that Req fulfils.
"""
# <<< ch17

from __future__ import annotations

from typing import Protocol

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch17: the prefix cache
from collections.abc import Callable

from minioverlap.cache.radix import Node, RadixCache
# <<< ch17


class CachedReq(Protocol):
    """What the manager reads and writes of a request (the engine's Req has it all): the cache sits below
    the engine and imports nothing of it."""
    uid: int
    row: int                           # its request slot (0: none)
    pages: list[int]                   # the pages holding its K and V, in order
    seq_len: int                       # tokens whose K and V are in the cache once the launched steps run
    # >>> ch17: its cached prefix
    prompt_ids: list[int]
    output_ids: list[int]
    error: str | None
    cached_len: int                    # its first tokens whose pages the tree holds
    cached_tokens: int                 # prompt tokens served from the cache at admission
    last_node: Node | None             # the tree node where they end, locked while it runs
    # <<< ch17
    # >>> ch21: what its prefill lays out, after a retraction its outputs too
    recomputed: int                    # its output tokens laid out again
    fill_ids: list[int]
    # <<< ch21


class CacheManager:
    """A request's slot and pages: who holds each, and what is free."""
    # >>> ch17: the prefix cache, if enable_tree made it
    tree: RadixCache | None = None
    # <<< ch17

    def __init__(self, allocator: PageAllocator, tables: ReqToTokenPool) -> None:
        """Over the pool's page allocator and the request tables, which the runner makes."""
        self.allocator, self.tables = allocator, tables
        self.page_size = allocator.page_size

    def admit(self, req: CachedReq) -> None:
        """Give the request a request slot. From chapter 17 the KV slots of its cached prefix go into its row
        (a write of a shared table, through the tables that record it: the fence orders it)."""
        req.row = self.tables.alloc()
        # >>> ch17: a cached prefix: the tree's pages into its row
        if req.cached_len:
            self.tables.write(req.row, 0, self.allocator.kv_slots(req.pages, 0, req.cached_len))
        # <<< ch17

    def release(self, req: CachedReq) -> None:
        """Give back the request's pages and its request slot."""
        # >>> ch17 replaces ch02: what handled steps computed goes into the tree; its own pages go back, its path unlocked
        #| self.allocator.free(req.pages)
        #| self.tables.free(req.row)
        if self.tree is not None and req.last_node is not None:
            if req.row and req.output_ids and req.error is None:     # it ran here, and made tokens
                self.cache_req(req)
            self.tree.unlock(req.last_node)
        self.allocator.free(req.pages[req.cached_len // self.page_size:])
        if req.row:
            self.tables.free(req.row)
        req.cached_len, req.last_node = 0, None
        # <<< ch17
        req.pages, req.row = [], 0

    @property
    def available_size(self) -> int:
        """Pages a request may still be given."""
        # >>> ch17 replaces ch02: pages the tree holds for no running request are free to take (it evicts them)
        #| return self.allocator.num_free
        return self.allocator.num_free + (self.tree.evictable_pages if self.tree else 0)
        # <<< ch17
    # >>> ch17: the prefix cache

    def enable_tree(self, bigram: bool = False) -> None:
        """Keep what requests computed in a radix tree over the pool, whose pages it holds too; the
        allocator comes to it when the free list runs short. Its keys are token_key's, or with an MTP
        drafter (`bigram`) bigram_key's: what a position's K and V depend on."""
        self.tree = RadixCache(self.allocator)
        self.key: Callable[[list[int]], list] = bigram_key if bigram else token_key

    def match_req(self, req: CachedReq) -> None:
        """Before admission: the longest cached prefix of its prompt becomes its first pages, locked for it;
        its prefill starts after them. `release` undoes it if it is not admitted after all."""
        if self.tree is None:
            return
        # >>> ch21 replaces ch17: what it fills (after a retraction its outputs too); cached_tokens counted at its first admission
        #| pages, req.last_node = self.tree.match_prefix(self.key(req.prompt_ids))
        #| self.tree.lock(req.last_node)
        #| req.pages = pages
        #| req.cached_len = req.cached_tokens = req.seq_len = len(pages) * self.page_size
        pages, req.last_node = self.tree.match_prefix(self.key(req.fill_ids))
        self.tree.lock(req.last_node)
        req.pages = pages
        req.cached_len = req.seq_len = len(pages) * self.page_size
        if not req.recomputed:
            req.cached_tokens = req.cached_len
        # <<< ch21

    def cache_req(self, req: CachedReq, end: int | None = None) -> None:
        """Insert the tokens whose K and V handled steps computed in whole pages: its first `end` (what a
        handled prefill computed), or all but its newest token, whose K and V the next step computes.
        Pages the tree already held replace its own copies, which go back (its row is rewritten: a write
        of a shared table, after the fence). It then locks the node where they end instead of the one it
        held."""
        if self.tree is None:
            return
        size = self.page_size
        key = self.key(req.prompt_ids + req.output_ids)[:end]
        n = len(key) // size
        held, pages, node = self.tree.insert(key[:n * size], req.pages[:n])
        start = req.cached_len // size
        duplicates = req.pages[start:held]                  # its own copies of pages the tree held already
        req.pages[:n] = pages
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.cached_len, req.last_node = n * size, node
        self.allocator.free(duplicates)
        if duplicates:
            self.tables.write(req.row, start * size, self.allocator.kv_slots(pages, start * size, held * size))
    # <<< ch17
    # >>> ch04: the integrity check

    def integrity_problems(self, owners: list[CachedReq]) -> list[str]:
        """Every page and request slot is free or owned by exactly one of `owners`, and each owner's
        req_to_token row points at its own pages."""
        problems = []
        # >>> ch17 replaces ch04: a request owns its pages past its cached prefix; the tree owns the rest, once
        #| owned_pages = [p for r in owners for p in r.pages]
        owned_pages = [p for r in owners for p in r.pages[r.cached_len // self.page_size:]]
        if self.tree is not None:
            owned_pages += self.tree.pages()
            problems += self.tree.problems([r.last_node for r in owners])
            problems += [f"request {r.uid}: its cached pages are not its tree path's" for r in owners
                         if r.pages[:r.cached_len // self.page_size] != self.tree.path_pages(r.last_node)]
        # <<< ch17
        for what, owned, free, total in (
                ("page", owned_pages, self.allocator.free_pages, self.allocator.num_pages),
                ("request slot", [r.row for r in owners], self.tables.free_rows, len(self.tables.is_free))):
            counts = {i: 0 for i in range(1, total)}
            for i in [*owned, *free]:
                counts[i] = counts.get(i, 0) + 1
            problems += [f"{what} {i} is {'lost' if n == 0 else f'owned or free {n} times'}"
                         for i, n in counts.items() if n != 1]
        for r in owners:
            if self.tables.slots_of(r.row, r.seq_len) != self.allocator.kv_slots(r.pages, 0, r.seq_len):
                problems.append(f"request {r.uid}: req_to_token row {r.row} does not point at its pages")
        return problems
    # <<< ch04
# >>> ch17: the tree's key of a token sequence


def token_key(tokens: list[int]) -> list:
    """The tree's key of a token sequence: an entry for each position but the last, the token there.
    The last position's K and V are the next step's to compute: a prompt's last token must run for
    its logits, and a request's newest token has not run yet."""
    return tokens[:-1]


def bigram_key(tokens: list[int]) -> list:
    """With an MTP drafter: its K and V at a position were computed from the token after it, so a cached
    position is shared only by sequences that agree on the next token too. The key of each position is
    the pair (its token, the next one), SGLang's bigram key; the same count of entries as token_key's."""
    return list(zip(tokens, tokens[1:]))
# <<< ch17
