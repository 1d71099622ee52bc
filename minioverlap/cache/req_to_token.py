# >>> ch02 file: the request tables
"""Per-request device tables, one row per request slot.

`req_to_token[row, pos]` is the KV slot of the token at position `pos` of the request in that row:
attention reads K and V through it. `token_pool[row, pos]` (chapter 03) is the token id itself: the
prompt, then each generated token; a step reads its input tokens from there. Row 0 belongs to no
request: padded rows of a batch point there.
"""

from __future__ import annotations

import torch

# >>> ch08: the checker, and no blocking on the schedule stream
from minioverlap.device.hazard import HazardChecker
from minioverlap.device.streams import to_device
# <<< ch08


class ReqToTokenPool:
    def __init__(self, max_running: int, max_seq_len: int, device: str | torch.device) -> None:
        self.req_to_token = torch.zeros((max_running + 1, max_seq_len), dtype=torch.int32, device=device)
        # >>> ch03: the tokens themselves
        self.token_pool = torch.zeros((max_running + 1, max_seq_len), dtype=torch.int32, device=device)
        # <<< ch03
        self.free_rows = list(range(max_running, 0, -1))      # row 0 is never handed out
        self.is_free = [False] + [True] * max_running
        # >>> ch08: the checker
        self.hazards: HazardChecker | None = None
        # <<< ch08

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
        if self.hazards:
            self.hazards.access(name, [(row, i) for i in range(start, start + len(values))], "write", site)
    # <<< ch08
