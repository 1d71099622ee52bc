# >>> ch02 file: the request tables
"""Per-request device tables, one row per request slot.

`req_to_token[row, pos]` is the KV slot of the token at position `pos` of the request in that row:
attention reads K and V through it. `token_pool[row, pos]` (chapter 03) is the token id itself: the
prompt, then each generated token; a step reads its input tokens from there. Row 0 belongs to no
request: padded rows of a batch point there.

Both streams use these tables, so every read and write of them goes through a method here: the scheduler
writes host lists (`write`, `write_tokens`); a step reads and writes with device index tensors
(`page_table`, `read_tokens`, `write_prompts`, `write_next_tokens`). From chapter 08 each of those
methods also tells the hazard checker what it touched, so the record is the operation itself.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

# >>> ch08: the checker, and no blocking on the schedule stream
from minioverlap.device.hazard import HazardChecker
from minioverlap.device.transfer import to_device
# <<< ch08


class Batch(Protocol):
    """What the tables read of a step's batch (the engine's ForwardBatch has it all): the tables sit
    below the engine and import nothing of it."""
    req_pool_indices: torch.Tensor     # [B] each request's row
    positions: torch.Tensor            # [T] the positions the step runs
    seq_lens: torch.Tensor             # [B] each request's length after the step
    max_seq_len: int                   # the longest row the step reads
    # >>> ch03: the inputs are read from token_pool
    token_rows: torch.Tensor           # [T] the row each position's token is read from
    # <<< ch03
    # >>> ch08: a prefill writes its own prompt; the cells each access touches, for the checker
    prompt_tokens: torch.Tensor | None

    def page_cells(self) -> list[tuple[int, int]]: ...
    def new_cells(self) -> list[tuple[int, int]]: ...
    def next_cells(self) -> list[tuple[int, int]]: ...
    # <<< ch08
    # >>> ch09: MTP: a verify step's window
    def window_cells(self, start: int, end: int) -> list[tuple[int, int]]: ...
    # <<< ch09
    # >>> ch15: the new KV slots, written from the batch's own index tensors
    out_cache_loc: torch.Tensor        # [T] the KV slot of each position the step runs
    rows: list[int]                    # [B] each request's row, on the host
    prefix_lens: list[int]             # [B] each request's first new position

    def ends(self) -> list[int]: ...
    # <<< ch15
    # >>> ch18: a mixed step's prompt rows
    def prompt_cells(self) -> list[tuple[int, int]]: ...
    # <<< ch18


class ReqToTokenPool:
    """The request tables and their free request slots."""

    # >>> ch08 replaces ch02: the checker sees every access
    #| def __init__(self, max_running: int, max_seq_len: int, device: str | torch.device) -> None:
    def __init__(self, max_running: int, max_seq_len: int, device: str | torch.device,
                 hazards: HazardChecker | None = None) -> None:
        self.hazards = hazards
        # <<< ch08
        self.req_to_token = torch.zeros((max_running + 1, max_seq_len), dtype=torch.int32, device=device)
        # >>> ch03: the tokens themselves
        self.token_pool = torch.zeros((max_running + 1, max_seq_len), dtype=torch.int32, device=device)
        # <<< ch03
        self.free_rows = list(range(max_running, 0, -1))      # row 0 is never handed out
        self.is_free = [False] + [True] * max_running

    @property
    def num_free(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int:
        if not self.free_rows:
            raise RuntimeError(f"no free request slot: all {len(self.is_free) - 1} are in use")
        row = self.free_rows.pop()
        self.is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if not 0 < row < len(self.is_free):
            raise ValueError(f"row {row} is not a request slot (1..{len(self.is_free) - 1})")
        if self.is_free[row]:
            raise ValueError(f"double free: request slot {row} is already free")
        self.is_free[row] = True
        self.free_rows.append(row)
    # >>> ch04: the integrity check

    def slots_of(self, row: int, length: int) -> list[int]:
        """The KV slots of positions 0..length-1 of `row`, read back by the host (the integrity check's
        read, made when no step is in flight)."""
        return self.req_to_token[row, :length].tolist()
    # <<< ch04

    # ---- the scheduler's writes: host lists
    def write(self, row: int, start: int, kv_slots: list[int]) -> None:
        """Record the KV slots of positions start.. of the request in `row`."""
        # >>> ch08 replaces ch02: never block on the schedule stream; tell the checker
        #| self.req_to_token[row, start:start + len(kv_slots)] = torch.tensor(kv_slots, dtype=torch.int32)
        self.scheduler_write("req_to_token", row, start, kv_slots, f"the scheduler writes the KV slots of row {row}")
        # <<< ch08
    # >>> ch03: the tokens themselves

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Record token ids at positions start.. of the request in `row` (its prompt, or a new token)."""
        # >>> ch08 replaces ch03: never block on the schedule stream; tell the checker
        #| self.token_pool[row, start:start + len(token_ids)] = torch.tensor(token_ids, dtype=torch.int32)
        self.scheduler_write("token_pool", row, start, token_ids, f"the scheduler writes tokens into row {row}")
        # <<< ch08
    # <<< ch03
    # >>> ch08: never block on the schedule stream; tell the checker

    def scheduler_write(self, name: str, row: int, start: int, values: list[int], site: str) -> None:
        """values -> positions start.. of `row` of the table `name`, with no host wait; the checker sees it."""
        table = getattr(self, name)
        table[row, start:start + len(values)] = to_device(values, torch.int32, table.device)
        self.record(name, lambda: [(row, i) for i in range(start, start + len(values))], "write", site)
    # <<< ch08

    # ---- a step's accesses: device index tensors, on the step's stream
    def page_table(self, batch: Batch,
                   # >>> ch08: which pass reads it, for the checker's reports
                   reader: str = "attention",
                   # <<< ch08
                   ) -> torch.Tensor:
        """Each request's row of req_to_token, [B, L] with L its longest sequence (past a request's own
        length the slots are stale and masked). A pass reads it once, before any layer runs."""
        # >>> ch08: the checker
        self.record("req_to_token", batch.page_cells, "read", f"{reader} reads the page table")
        # <<< ch08
        return self.req_to_token[batch.req_pool_indices, :batch.max_seq_len]
    # >>> ch03: the inputs are read from token_pool

    def read_tokens(self, batch: Batch) -> torch.Tensor:
        """The step's input tokens [T], one per position it runs."""
        # >>> ch08: the checker
        self.record("token_pool", batch.new_cells, "read", "the step reads its input tokens")
        # <<< ch08
        return self.token_pool[batch.token_rows, batch.positions].long()
    # <<< ch03
    # >>> ch05: the sampler's token stays on the device

    def write_next_tokens(self, batch: Batch, tokens: torch.Tensor) -> None:
        """Each request's sampled token, at its position seq_len: the next step's input."""
        # >>> exercise 05.1: keep the token on the device
        self.token_pool[batch.req_pool_indices, batch.seq_lens] = tokens.to(torch.int32)
        # <<< exercise 05.1
        # >>> ch08: the checker
        self.record("token_pool", batch.next_cells, "write", "the sampler writes the next input tokens")
        # <<< ch08
    # <<< ch05
    # >>> ch09: MTP: a verify step's window in token_pool

    def write_drafts(self, batch: Batch, drafts: torch.Tensor) -> None:
        """The k drafts [B, k] after each request's bonus token: positions L+1..L+k, the verify's input."""
        B, W = drafts.shape[0], drafts.shape[1] + 1
        self.token_pool[batch.req_pool_indices[:, None], batch.positions.view(B, W)[:, 1:]] = drafts.to(torch.int32)
        self.record("token_pool", lambda: batch.window_cells(1, W), "write", "the drafter writes the drafts")

    def write_window(self, batch: Batch, tokens: torch.Tensor) -> None:
        """A verify step's tokens [B, W] at positions L+1..L+W: the accepted drafts, then the next bonus
        token at L + accept_len (what lies beyond it is never read: the next window overwrites it)."""
        B, W = tokens.shape
        self.token_pool[batch.req_pool_indices[:, None], batch.positions.view(B, W) + 1] = tokens.to(torch.int32)
        self.record("token_pool", lambda: batch.window_cells(1, W + 1), "write", "the verify writes its accepted tokens")
    # <<< ch09
    # >>> ch10: a window's KV slots, read on the device

    def kv_slots_at(self, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """req_to_token at each request's positions [B, W] -> KV slots [B*W]."""
        self.record("req_to_token", lambda: batch.window_cells(0, positions.shape[1]), "read", "the step looks up its window's KV slots")
        return self.req_to_token[batch.req_pool_indices[:, None], positions].flatten().long()
    # <<< ch10
    # >>> ch15: a step's new KV slots in one write

    def write_new_slots(self, batch: Batch) -> None:
        """Each request's new KV slots at its new positions: out_cache_loc at (token_rows, positions), the
        batch's own device tensors, in one write. Chapter 02's `write` copies a host list a request
        (through pinned memory from chapter 08): B copies a step, where this makes none."""
        self.req_to_token[batch.token_rows, batch.positions] = batch.out_cache_loc.to(self.req_to_token.dtype)
        for row, start, end in zip(batch.rows, batch.prefix_lens, batch.ends()):
            self.record("req_to_token", lambda: [(row, i) for i in range(start, end)], "write",
                        f"the scheduler writes the KV slots of row {row}")
    # <<< ch15
    # >>> ch16: repetition_penalty: the tokens each request has generated

    def read_outputs(self, batch: Batch, prompt_lens: list[int]) -> torch.Tensor:
        """token_pool's row of each request of the step, up to the longest it reads: [B, L]. The sampler
        counts the tokens after each prompt (its own position's and those before; with MTP, the drafts)."""
        self.record("token_pool", lambda: [(row, i) for row, p, end in zip(batch.rows, prompt_lens, batch.ends())
                                           for i in range(p, end)], "read", "the sampler reads the tokens generated")
        return self.token_pool[batch.req_pool_indices, :batch.max_seq_len]
    # <<< ch16
    # >>> ch08: a prefill writes its own prompt; every access is recorded

    def write_prompts(self, batch: Batch) -> None:
        """A prefill's prompt tokens, at the positions it runs."""
        # >>> ch18 replaces ch08: a mixed step's prompt tokens are its first (its decode rows follow them)
        #| self.token_pool[batch.token_rows, batch.positions] = batch.prompt_tokens
        #| self.record("token_pool", batch.new_cells, "write", "the prefill writes its prompt")
        n = len(batch.prompt_tokens)
        self.token_pool[batch.token_rows[:n], batch.positions[:n]] = batch.prompt_tokens
        self.record("token_pool", batch.prompt_cells, "write", "the prefill writes its prompt")
        # <<< ch18

    def record(self, name: str, cells: Callable[[], list[tuple[int, int]]], kind: str, site: str) -> None:
        """Tell the checker, if there is one, that the current stream read or wrote the cells that `cells()`
        lists. The list is made only when a checker listens: a step's page cells alone are every position
        of every request, too many to build on each step for nobody."""
        if self.hazards:
            self.hazards.access(name, cells(), kind, site)
    # <<< ch08
