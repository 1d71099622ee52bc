# >>> ch02 file: one step's batch
"""ForwardBatch: what one forward step needs, in SGLang's vocabulary.

A step is either EXTEND (prefill: each request appends several tokens, its prompt or the rest of it)
or DECODE (each request appends exactly one token). The tokens of all requests are laid end to end:

    input_ids     [T]   the tokens to run
    positions     [T]   their positions in their own sequences
    out_cache_loc [T]   the KV slot each token's K and V are written to
    req_pool_indices [B]  each request's row in req_to_token
    seq_lens      [B]   each request's length after this step
    prefix_lens / extend_lens (host lists)  tokens already cached / appended now, per request

The host keeps its own copies of the sizes (prefix_lens, extend_lens, max_seq_len): reading a device
tensor back to decide a shape would make the host wait for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch08: never block on the schedule stream; events
from minioverlap.device.streams import Event
from minioverlap.device.transfer import to_device
# <<< ch08
from minioverlap.engine.request import Req


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: torch.Tensor | None   # from chapter 03 read from token_pool as the step runs
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: list[int]              # the request slots this step reads and writes (host copy)
    pages: list[int]             # the pages of its requests, whose KV slots it reads and writes
    last_index: torch.Tensor     # [B] where each request's last token sits in the batch
    # >>> ch03: the inputs are read from token_pool
    token_rows: torch.Tensor | None = None   # [T] the token_pool row each token's input is read from
    # <<< ch03
    # >>> ch08: a prefill writes its own prompt; the event the fence waits for
    prompt_tokens: torch.Tensor | None = None   # [T] EXTEND: the tokens the step writes into token_pool
    read_done: Event | None = None   # recorded once the step has read the shared tables
    # <<< ch08

    @property
    def max_seq_len(self) -> int:
        return max(p + n for p, n in zip(self.prefix_lens, self.extend_lens))
    # >>> ch08: the cells of the request tables a step touches, (row, position), for the checker

    def page_cells(self) -> list[tuple[int, int]]:
        """Every position of each request's row: what attention reads of req_to_token."""
        return [(row, i) for row, p, n in zip(self.rows, self.prefix_lens, self.extend_lens) for i in range(p + n)]

    def new_cells(self) -> list[tuple[int, int]]:
        """The positions this step runs: its input tokens (and a prefill's prompt) in token_pool."""
        return [(row, i) for row, p, n in zip(self.rows, self.prefix_lens, self.extend_lens) for i in range(p, p + n)]

    def next_cells(self) -> list[tuple[int, int]]:
        """Each request's position seq_len: where the sampler writes its next input token."""
        return [(row, p + n) for row, p, n in zip(self.rows, self.prefix_lens, self.extend_lens)]
    # <<< ch08


def allocate_kv(req: Req, num_tokens: int, allocator: PageAllocator, tables: ReqToTokenPool) -> list[int]:
    """Give req room for num_tokens more tokens: new pages if needed, their KV slots into req_to_token."""
    start, end = req.seq_len, req.seq_len + num_tokens
    req.pages += allocator.alloc(allocator.pages_for(end) - len(req.pages))
    slots = allocator.kv_slots(req.pages, start, end)
    tables.write(req.row, start, slots)
    req.seq_len = end
    return slots


def build_batch(mode: ForwardMode, reqs: list[Req], allocator: PageAllocator, tables: ReqToTokenPool,
                device: str | torch.device) -> ForwardBatch:
    """Allocate KV for each request's new tokens and lay the batch out.

    EXTEND runs the rest of each prompt; DECODE runs each request's newest token, whose K/V are not
    cached yet. Either way a request's new tokens are its positions prefix_len .. seq_len-1.
    """
    prefix_lens = [r.seq_len for r in reqs]
    extend_lens = [len(r.prompt_ids) - r.seq_len if mode is ForwardMode.EXTEND else 1 for r in reqs]
    loc = [slot for r, n in zip(reqs, extend_lens) for slot in allocate_kv(r, n, allocator, tables)]
    positions = [p for start, n in zip(prefix_lens, extend_lens) for p in range(start, start + n)]

    def tensor(values: list[int]) -> torch.Tensor:
        """A host list as an index tensor on the device."""
        # >>> ch08 replaces ch02: never block on the schedule stream
        #| return torch.tensor(values, dtype=torch.int64, device=device)
        return to_device(values, torch.int64, device)
        # <<< ch08

    # >>> ch03 replaces ch02: the inputs are read from token_pool when the step runs (ModelRunner.forward)
    #| input_ids = tensor([t for r, start, n in zip(reqs, prefix_lens, extend_lens)
    #|                     for t in (r.prompt_ids + r.output_ids)[start:start + n]])
    input_ids = None
    # <<< ch03
    rows = [r.row for r in reqs]
    last_index = tensor([sum(extend_lens[:i + 1]) - 1 for i in range(len(reqs))])
    batch = ForwardBatch(mode, reqs, input_ids, tensor(positions), tensor(loc), tensor(rows),
                         tensor([r.seq_len for r in reqs]), prefix_lens, extend_lens, rows,
                         [p for r in reqs for p in r.pages], last_index)
    # >>> ch03: the inputs are read from token_pool
    batch.token_rows = tensor([r.row for r, n in zip(reqs, extend_lens) for _ in range(n)])
    # <<< ch03
    # >>> ch08: a prefill writes its own prompt
    if mode is ForwardMode.EXTEND:
        batch.prompt_tokens = to_device([t for r, start, n in zip(reqs, prefix_lens, extend_lens)
                                         for t in r.prompt_ids[start:start + n]], torch.int32, device)
    # <<< ch08
    return batch
