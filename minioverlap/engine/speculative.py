# >>> ch09 file: one speculative step with the MTP drafter
"""One MTP step: draft, verify, accept, draft extend. All of it is queued on the device; the host learns
the outcome (each request's window of tokens and how many count) when it handles the step.

A request with committed length L (the target's and the MTP layer's KV hold positions 0..L-1) has its
bonus token b at position L (in token_pool, sampled by the previous step) and the MTP layer's first
draft d1 with the hidden state that produced it (from the previous step's draft extend). A decode step:

    draft         k-1 MTP passes, one row each, chain d1 -> d2 -> ... -> dk; the row at position L+i-1
                  reads d(i) and the previous row's MTP hidden state
    verify        the target runs the window b, d1..dk at positions L..L+k (its KV written for all k+1)
    accept        the accept rule (accept.py): tokens [k+1], accept_len = a+1
    draft extend  the MTP layer runs the same window with the target's hidden states and the accepted
                  tokens, rewriting its KV there; the row of the last accepted position gives the next
                  step's d1 and hidden state

KV written at rejected positions lies past the new length L+a+1; the next window starts there and
overwrites it. A prefill step runs the target over the prompt, samples the bonus token and runs the
draft extend over the prompt (each row reads the next prompt token; the last row reads the bonus).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from minioverlap.engine.accept import accept
from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.sampler import sample

if TYPE_CHECKING:
    from minioverlap.engine.model_runner import ModelRunner


def speculate(runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step -> each request's window of tokens [B, W] and accept_lens [B] (W = 1 for a prefill)."""
    # >>> ch10: the host gave a verify step slot numbers only: the relay gives the rest, on the device
    if batch.mode is ForwardMode.TARGET_VERIFY:
        runner.resolve(batch)
    # <<< ch10
    ctx = runner.attention(batch)
    if batch.mode is ForwardMode.EXTEND:
        return prefill(runner, batch, ctx)
    return verify(runner, batch, ctx)


def prefill(runner: ModelRunner, batch: ForwardBatch, ctx: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over the prompts, the bonus token sampled, the draft extend over the prompts."""
    hidden = runner.hidden_states(batch, ctx)
    bonus = sample(runner.model.compute_logits(hidden[batch.last_index]), batch.reqs)
    runner.tables.write_next_tokens(batch, bonus)
    # >>> ch10: where each request's first window starts
    runner.relay.publish(batch.req_pool_indices, batch.rows, batch.seq_lens)
    # <<< ch10
    next_ids = batch.input_ids.roll(-1)                  # row p reads token p+1 ...
    next_ids[batch.last_index] = bonus                   # ... and the last row the bonus token
    draft_extend(runner, batch, next_ids, hidden, batch.last_index)
    return bonus[:, None], torch.ones_like(bonus)


def verify(runner: ModelRunner, batch: ForwardBatch, ctx: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft k tokens, verify them with one target pass, accept, and draft-extend over the window."""
    B, W = len(batch.reqs), batch.extend_lens[0]
    # >>> ch13 replaces ch09: with graphs, the draft passes and the target's pass are one replay each
    #| drafts = draft(runner, batch, ctx, W - 1)
    #| runner.tables.write_drafts(batch, drafts)            # the window b, d1..dk in token_pool: the verify's input
    #| hidden = runner.hidden_states(batch, ctx)
    graphs = runner.graphs
    drafts = graphs.draft(batch, ctx.page_table) if graphs else draft(runner, batch, ctx, W - 1)
    runner.tables.write_drafts(batch, drafts)            # the window b, d1..dk in token_pool: the verify's input
    hidden = runner.replay_target(batch) if graphs else runner.hidden_states(batch, ctx)
    # <<< ch13
    logits = runner.model.compute_logits(hidden).view(B, W, -1)
    tokens, accept_lens = accept(logits, drafts, batch.reqs)
    runner.tables.write_window(batch, tokens)            # the accepted tokens, and the next bonus at L + accept_len
    # >>> ch10: where each request's next window starts
    runner.relay.publish(batch.req_pool_indices, batch.rows, batch.seq_lens - W + accept_lens)
    # <<< ch10
    last = torch.arange(B, device=tokens.device) * W + accept_lens - 1     # each request's last accepted row
    draft_extend(runner, batch, tokens.flatten(), hidden, last)
    return tokens, accept_lens


def draft(runner: ModelRunner, batch: ForwardBatch, ctx: PagedAttention, k: int) -> torch.Tensor:
    """d1 from the last draft extend, then k-1 MTP passes, each the drafter's argmax -> drafts [B, k]."""
    token, hidden = batch.draft_inputs
    drafts = [token]
    for i in range(1, k):
        row = draft_row(batch, i - 1)
        hidden = runner.mtp(token, hidden, row.positions, PagedAttention(runner.draft_kv_pool, ctx.page_table, row))
        token = runner.mtp.compute_logits(hidden).argmax(dim=-1)
        drafts.append(token)
    return torch.stack(drafts, dim=1)


def draft_row(batch: ForwardBatch, j: int) -> ForwardBatch:
    """Window row j of every request as a decode batch: position L+j, its KV slot, L+j+1 keys visible."""
    B, W = len(batch.reqs), batch.extend_lens[0]
    return replace(batch, mode=ForwardMode.DECODE, positions=batch.positions.view(B, W)[:, j],
                   out_cache_loc=batch.out_cache_loc.view(B, W)[:, j], seq_lens=batch.seq_lens - W + j + 1)


def draft_extend(runner: ModelRunner, batch: ForwardBatch, next_ids: torch.Tensor, hidden: torch.Tensor,
                 last: torch.Tensor) -> None:
    """The MTP layer over the step's rows (tokens p+1, the target's hidden states at p): its KV for
    them, and from each request's `last` row the next first draft and its hidden state. Like SGLang's
    draft extend, a pass of its own: it prepares its own attention context, reading the page table."""
    page_table = runner.tables.page_table(batch, "the draft extend")
    # >>> ch12 fix read-done-after-draft-extend: with MTP this is the step's last read of a table the scheduler writes
    batch.read_done = runner.streams.record()
    # <<< ch12
    # >>> ch13: with graphs, a verify's draft extend is one replay
    if runner.graphed(batch):
        runner.stash_drafts(batch, *runner.graphs.draft_extend(batch, next_ids, last, page_table))
        return
    # <<< ch13
    runner.stash_drafts(batch, *extend_rows(runner, batch, next_ids, hidden, last, page_table))


def extend_rows(runner: ModelRunner, batch: ForwardBatch, next_ids: torch.Tensor, hidden: torch.Tensor,
                last: torch.Tensor, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over the rows -> from each request's `last` row its next first draft [B] and hidden state."""
    out = runner.mtp(next_ids, hidden, batch.positions, PagedAttention(runner.draft_kv_pool, page_table, batch))[last]
    return runner.mtp.compute_logits(out).argmax(dim=-1), out
