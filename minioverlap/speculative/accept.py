# >>> ch09 file: the accept rules of speculative decoding
"""Which drafts the target accepts, and the token that follows them.

A verify step runs each request's window of W = k+1 positions: the bonus token (certain, sampled by the
previous step) and the k drafts d1..dk. Row j of the target's logits is its distribution for the
position after window token j, so row j judges draft d(j+1), and the row after the last accepted draft
gives one more token of the target's own. For each request the result is a window of W tokens of which
the first `accept_len` count (1 <= accept_len <= W):

    tokens[:accept_len] = d1 .. da, then the target's own token     (a = accept_len - 1 drafts accepted)

Greedy: a draft is accepted while it equals the target's argmax; the token after them is the argmax at
the first mismatch. The tokens are exactly greedy decoding's, whatever the drafts (lossless).

Sampling: the drafts are the drafter's argmax, a one-hot proposal, so speculative sampling (Leviathan
et al., 2023; Chen et al., 2023) reduces to: accept d with probability p(d), where p is the target's
adjusted distribution at that row (temperature, top-k, top-p); at the first rejection draw from p with d
removed and renormalised; if every draft is accepted, draw from the last row's p. Each token then has
exactly the distribution p that plain sampling draws it from. (SGLang's target-only verify kernel does
the same with its thresholds at their default of 1.)

Everything stays on the device: the host learns accept_len with the tokens, when it handles the step.
"""

from __future__ import annotations

import torch

from minioverlap.engine.request import Req
from minioverlap.engine.sampler import adjusted_probs, fail_alone
# >>> ch19: the grammars of a window's requests
from minioverlap.engine.sampler import live_grammars
# <<< ch19


def accept(logits: torch.Tensor, drafts: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, W, vocab] of the verify step, drafts [B, W-1] -> tokens [B, W] and accept_lens [B]. From
    chapter 19 a constrained request's rows come masked (mask_window), each by its grammar after the drafts
    before it."""
    tokens = logits.argmax(dim=-1)
    accept_lens = accept_greedy(drafts, tokens)
    for i, req in enumerate(reqs):
        if req.params.temperature > 0:
            tokens[i], accept_lens[i] = fail_alone(req, accept_sampled, logits[i], drafts[i], req,
                                                   default=(tokens[i], accept_lens[i]))
    return tokens, accept_lens


def accept_greedy(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [B, k] and the target's argmax at every window row [B, k+1] -> accept_lens [B]: the number of
    leading drafts equal to the target's choice, plus one (the target's own token after them)."""
    # >>> exercise 09.1: the greedy accept rule
    agree = (drafts == target[:, :-1]).long()
    return agree.cumprod(dim=1).sum(dim=1) + 1
    # <<< exercise 09.1


def accept_sampled(logits: torch.Tensor, drafts: torch.Tensor, req: Req) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: logits [k+1, vocab], drafts [k] -> its window of tokens [k+1] and accept_len (0-d).
    Draws k coins and one token from the request's generator, so a seeded request is reproducible."""
    # >>> exercise 09.2: the sampling accept rule
    k = drafts.shape[0]
    probs = adjusted_probs(logits, req.params)                               # [k+1, vocab]
    probs = probs / probs.sum(dim=-1, keepdim=True)                         # top-p leaves less than 1: p sums to 1
    p_draft = probs[:k].gather(1, drafts[:, None])[:, 0]                     # p(d) at each draft's row
    coins = torch.rand(k, generator=req.generator, device=logits.device, dtype=probs.dtype)
    accepted = (coins < p_draft).long().cumprod(dim=0).sum()                # a: drafts accepted
    residual = probs.clone()
    residual[:k].scatter_(1, drafts[:, None], 0.0)                          # each row's p with its draft removed
    token = torch.multinomial(residual[accepted], 1, generator=req.generator)[0]   # row k keeps its whole p
    window = torch.cat((drafts, drafts[:1]))
    window = torch.where(torch.arange(k + 1, device=logits.device) == accepted, token, window)
    return window, accepted + 1
    # <<< exercise 09.2
# >>> ch19: grammar-constrained windows


def mask_window(logits: torch.Tensor, drafts: list[list[int]], reqs: list[Req]) -> torch.Tensor:
    """logits [B, W, vocab] and the drafts on the host -> the logits themselves if no request follows a
    grammar, else a copy with each constrained request's rows masked (window_bitmask). The accept rule
    over masked rows is still lossless: row j's mask is the one plain constrained decoding would use after
    d1..dj, and a draft its grammar forbids has probability 0 there, so it is never accepted."""
    if not any(req.grammar is not None for req in reqs):
        return logits
    from minioverlap.constrained.grammar import masked, window_bitmask   # xgrammar: see that module
    return masked(logits, window_bitmask(live_grammars(reqs), drafts, logits.shape[-1]))
# <<< ch19
