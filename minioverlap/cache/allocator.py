# >>> ch02 file: the page allocator
"""The page allocator: a free list of pages, each `page_size` consecutive KV slots.

Page p holds KV slots p*page_size .. (p+1)*page_size - 1. Page 0 is never handed out, so KV slot 0
belongs to no request: padded rows of a batch may read and write it freely.
"""

from __future__ import annotations

# >>> ch17: the prefix cache gives pages back when the free list runs short
from collections.abc import Callable
# <<< ch17

class OutOfPages(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (page 0 is reserved) and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages = list(range(num_pages - 1, 0, -1))   # a stack: the lowest page is handed out first
        self.is_free = [False] + [True] * (num_pages - 1)
        # >>> ch17: the prefix cache gives pages back when the free list runs short
        self.reclaim: Callable[[int], None] | None = None    # frees at least n more pages (RadixCache.evict)
        # <<< ch17

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int) -> list[int]:
        """n pages off the free list."""
        # >>> ch17: the prefix cache gives pages back when the free list runs short
        if n > len(self.free_pages) and self.reclaim is not None:
            self.reclaim(n - len(self.free_pages))
        # <<< ch17
        if n > len(self.free_pages):
            raise OutOfPages(f"asked for {n} pages, {len(self.free_pages)} of {self.num_pages - 1} are free")
        pages = [self.free_pages.pop() for _ in range(n)]
        for p in pages:
            self.is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not a page of this pool (1..{self.num_pages - 1})")
            if self.is_free[p]:
                raise ValueError(f"double free: page {p} is already free")
            self.is_free[p] = True
            self.free_pages.append(p)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens."""
        return -(-num_tokens // self.page_size)

    def kv_slots(self, pages: list[int], start: int, end: int) -> list[int]:
        """The KV slots of token positions start..end-1 of a sequence that owns `pages`, in order."""
        # >>> exercise 02.2: token positions to KV slots
        size = self.page_size
        return [pages[pos // size] * size + pos % size for pos in range(start, end)]
        # <<< exercise 02.2
