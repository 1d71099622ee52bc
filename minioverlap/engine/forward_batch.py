# >>> ch02 file: one step's batch
"""ForwardBatch: what one forward step needs, in SGLang's vocabulary.

A step is either EXTEND (prefill: each request appends several tokens, its prompt or the rest of it)
or DECODE (each request appends exactly one token). The tokens of all requests are laid end to end:

    input_ids     [T]   the tokens to run (chapter 02; from chapter 03 the step reads them from token_pool)
    positions     [T]   their positions in their own sequences
    out_cache_loc [T]   the KV slot each token's K and V are written to
    req_pool_indices [B]  each request's row in req_to_token
    seq_lens      [B]   each request's length after this step
    prefix_lens / extend_lens (host lists)  tokens already cached / appended now, per request

The host keeps its own copies of the sizes (prefix_lens, extend_lens, max_seq_len): reading a device
tensor back to decide a shape would make the host wait for the device. A batch is built once and never
changed (frozen): what the device works out later, as the step runs, comes back as a value of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
# >>> ch18: what a step's batch works out once
from functools import cached_property
# <<< ch18

import torch

from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.req_to_token import ReqToTokenPool
# >>> ch08: never block on the schedule stream
from minioverlap.device.transfer import to_device
# <<< ch08
# >>> ch15: the step's index lists in one copy
from minioverlap.device.transfer import to_device_together
# <<< ch15
from minioverlap.engine.request import Req


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"
    # >>> ch09: MTP's verify: a window of tokens per request, all requests at once
    TARGET_VERIFY = "verify"
    # <<< ch09


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    mode: ForwardMode
    reqs: list[Req]
    # >>> ch03 removes ch02: the step reads its input tokens from token_pool as it runs (ModelRunner.read_inputs)
    #| input_ids: torch.Tensor
    # <<< ch03
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
    # >>> ch08: a prefill writes its own prompt
    prompt_tokens: torch.Tensor | None = None   # [T] EXTEND: the tokens the step writes into token_pool
    # <<< ch08
    # >>> ch10 removes ch09: the relay holds the drafter's inputs; the step reads them (SpecRunner.resolve)
    #| draft_inputs: tuple[torch.Tensor, torch.Tensor] | None = None   # each request's first draft [B], MTP hidden [B, hidden]
    # <<< ch10
    # >>> ch12: where only the device knows a window's start, how far it may reach
    reach: list[int] | None = None   # TARGET_VERIFY: each request's reserved end; its window lies below it
    # <<< ch12

    @property
    def max_seq_len(self) -> int:
        """The longest row the step reads: the page table's width."""
        # >>> ch12 replaces ch02: a verify may reach as far as its requests reserved
        #| return max(p + n for p, n in zip(self.prefix_lens, self.extend_lens))
        return max(self.ends())
        # <<< ch12
    # >>> ch08: the cells of the request tables a step touches, (row, position), for the checker

    def ends(self) -> list[int]:
        """Each request's end: the step runs its positions prefix_len .. end-1 and reads 0 .. end-1."""
        # >>> ch12 replaces ch08: a verify's window starts where the relay says, at most one window past the host's count
        #| return [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        return self.reach or [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        # <<< ch12

    def page_cells(self) -> list[tuple[int, int]]:
        """Every position of each request's row: what attention reads of req_to_token."""
        return [(row, i) for row, end in zip(self.rows, self.ends()) for i in range(end)]

    def new_cells(self) -> list[tuple[int, int]]:
        """The positions this step runs: its input tokens (and a prefill's prompt) in token_pool."""
        return [(row, i) for row, p, end in zip(self.rows, self.prefix_lens, self.ends()) for i in range(p, end)]

    def next_cells(self) -> list[tuple[int, int]]:
        """Each request's position seq_len: where the sampler writes its next input token."""
        return [(row, p + n) for row, p, n in zip(self.rows, self.prefix_lens, self.extend_lens)]
    # <<< ch08
    # >>> ch16: the time to first token

    @property
    def gives_first_tokens(self) -> bool:
        """Whether handling the step gives requests their first tokens: a prefill (from chapter 18, a step
        that ends some request's prompt; a step of chunks alone gives none)."""
        # >>> ch18 replaces ch16: a chunk ends no prompt
        #| return self.mode is ForwardMode.EXTEND
        return any(p < len(r.prompt_ids) <= p + n for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens))
        # <<< ch18
    # <<< ch16
    # >>> ch17: what a handled prefill computed, for the prefix cache

    def prompt_rows(self) -> list[tuple[Req, int]]:
        """(request, end) of each request whose rows ran prompt tokens: its K and V are computed up to end."""
        # >>> ch21 replaces ch17: what it fills: after a retraction its outputs too
        #| return [(r, p + n) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens) if p < len(r.prompt_ids)]
        return [(r, p + n) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens) if p < r.fill_len]
        # <<< ch21
    # <<< ch17
    # >>> ch18: chunked prefill

    def chunks(self) -> list[bool]:
        """Whether each request's rows end inside its prompt: a chunk, whose prompt goes on in a later step.
        The token sampled after a chunk means nothing: it is no reply, and the next chunk, which writes its
        own prompt tokens first (chapter 08), overwrites it in token_pool."""
        # >>> ch21 replaces ch18: what it fills: after a retraction its outputs too
        #| return [p + n < len(r.prompt_ids) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens)]
        return [p + n < r.fill_len for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens)]
        # <<< ch21

    @cached_property
    def chunked(self) -> frozenset[Req]:
        """The requests whose rows are a chunk, made once (the result handling asks for each request)."""
        return frozenset(r for r, chunk in zip(self.reqs, self.chunks()) if chunk)

    def prompt_cells(self) -> list[tuple[int, int]]:
        """The positions whose input is a prompt token, which the step writes itself (a mixed step's decode
        rows read the token the step before sampled)."""
        # >>> ch21 replaces ch18: what it fills: after a retraction its outputs too
        #| return [(r.row, i) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens) if p < len(r.prompt_ids)
        #|         for i in range(p, p + n)]
        return [(r.row, i) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens) if p < r.fill_len
                for i in range(p, p + n)]
        # <<< ch21
    # <<< ch18
    # >>> ch09: MTP: a verify step's window in token_pool

    def window_cells(self, start: int, end: int) -> list[tuple[int, int]]:
        """Positions L+start .. L+end-1 of each request's row, L its committed length."""
        # >>> ch12 replaces ch09: L as far as the window may start: from the host's count to one window past it
        #| return [(row, p + j) for row, p in zip(self.rows, self.prefix_lens) for j in range(start, end)]
        W = self.extend_lens[0]
        return [(row, i) for row, p, e in zip(self.rows, self.prefix_lens, self.ends()) for i in range(p + start, e - W + end)]
        # <<< ch12
    # <<< ch09


# >>> ch15 replaces ch02: it only allocates; build_batch writes the batch's slots at once (write_new_slots)
#| def allocate_kv(req: Req, num_tokens: int, allocator: PageAllocator, tables: ReqToTokenPool) -> list[int]:
#|     """Give req room for num_tokens more tokens: new pages if needed, their KV slots into req_to_token."""
def allocate_kv(req: Req, num_tokens: int, allocator: PageAllocator) -> list[int]:
    """Give req room for num_tokens more tokens: new pages if needed -> their KV slots."""
# <<< ch15
    start, end = req.seq_len, req.seq_len + num_tokens
    req.pages += allocator.alloc(allocator.pages_for(end) - len(req.pages))
    slots = allocator.kv_slots(req.pages, start, end)
    # >>> ch15 removes ch02: build_batch writes them, with the whole batch's
    #| tables.write(req.row, start, slots)
    # <<< ch15
    req.seq_len = end
    return slots


def build_batch(mode: ForwardMode, reqs: list[Req], allocator: PageAllocator, tables: ReqToTokenPool,
                device: str | torch.device) -> ForwardBatch:
    """Allocate KV for each request's new tokens and lay the batch out.

    EXTEND runs the rest of each prompt; DECODE runs each request's newest token, whose K/V are not
    cached yet. Either way a request's new tokens are its positions prefix_len .. seq_len-1. From chapter
    18 a prompt runs the chunk the scheduler gave it, and a mixed step's decode rows (EXTEND steps too)
    one token each, after the prompts.
    """
    prefix_lens = [r.seq_len for r in reqs]
    # >>> ch18 replaces ch02: a prompt runs the chunk the scheduler gave it; a decode row (from chapter 18 in a mixed step too) one token
    #| extend_lens = [len(r.prompt_ids) - r.seq_len if mode is ForwardMode.EXTEND else 1 for r in reqs]
    extend_lens = [r.chunk_len() if r.prefilling else 1 for r in reqs]
    # <<< ch18
    # >>> ch15 replaces ch02: allocate_kv no longer writes req_to_token (write_new_slots, below)
    #| loc = [slot for r, n in zip(reqs, extend_lens) for slot in allocate_kv(r, n, allocator, tables)]
    loc = [slot for r, n in zip(reqs, extend_lens) for slot in allocate_kv(r, n, allocator)]
    # <<< ch15
    positions = [p for start, n in zip(prefix_lens, extend_lens) for p in range(start, start + n)]
    rows = [r.row for r in reqs]
    indices = dict(
        # >>> ch03 removes ch02: the inputs are read from token_pool when the step runs (ModelRunner.read_inputs)
        #| input_ids=[t for r, start, n in zip(reqs, prefix_lens, extend_lens)
        #|            for t in (r.prompt_ids + r.output_ids)[start:start + n]],
        # <<< ch03
        positions=positions, out_cache_loc=loc, req_pool_indices=rows, seq_lens=[r.seq_len for r in reqs],
        last_index=[sum(extend_lens[:i + 1]) - 1 for i in range(len(reqs))],
        # >>> ch03: the inputs are read from token_pool
        token_rows=[r.row for r, n in zip(reqs, extend_lens) for _ in range(n)],
        # <<< ch03
    )
    batch = ForwardBatch(
        mode, reqs, **index_tensors(indices, device), prefix_lens=prefix_lens, extend_lens=extend_lens, rows=rows,
        pages=[p for r in reqs for p in r.pages],
        # >>> ch08: a prefill writes its own prompt
        prompt_tokens=prompt_tokens(mode, reqs, prefix_lens, extend_lens, device),
        # <<< ch08
    )
    # >>> ch15: the new KV slots into req_to_token from the batch's own device indices: no copy of their own
    tables.write_new_slots(batch)
    # <<< ch15
    return batch


def index_tensors(lists: dict[str, list[int]], device: str | torch.device) -> dict[str, torch.Tensor]:
    """Host lists of indices as int64 tensors on the device, by name."""
    # >>> ch08 replaces ch02: never block on the schedule stream
    #| return {name: torch.tensor(values, dtype=torch.int64, device=device) for name, values in lists.items()}
    # >>> ch15 replaces ch08: all of them in one copy (the host's work per step)
    #| return {name: to_device(values, torch.int64, device) for name, values in lists.items()}
    return to_device_together(lists, torch.int64, device)
    # <<< ch15
    # <<< ch08
# >>> ch08: a prefill writes its own prompt


def prompt_tokens(mode: ForwardMode, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int],
                  device: str | torch.device) -> torch.Tensor | None:
    """A prefill's prompt tokens [T], which it writes into token_pool itself; None for a decode step. From
    chapter 18 a mixed step's are those of its prefill rows, laid out first: a decode row's input is the
    token the step before sampled, on the device (05); in the overlap loop the host has not received it
    yet (SGLang #2158)."""
    if mode is not ForwardMode.EXTEND:
        return None
    # >>> ch21 replaces ch08: what it fills: after a retraction its outputs too
    #| return to_device([t for r, start, n in zip(reqs, prefix_lens, extend_lens) for t in r.prompt_ids[start:start + n]],
    #|                  torch.int32, device)
    return to_device([t for r, start, n in zip(reqs, prefix_lens, extend_lens) if start < r.fill_len
                      for t in r.fill_ids[start:start + n]], torch.int32, device)
    # <<< ch21
# <<< ch08
