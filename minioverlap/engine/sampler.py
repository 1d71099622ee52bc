# >>> ch03 file: per-request sampling
"""The sampler: one next token per request, each by its own parameters.

Greedy rows take the argmax. The others divide their logits by the temperature, keep the top-k and
then the top-p of the distribution, and draw from it with the request's own generator when it has a
seed. A seeded request thus draws the same tokens whatever else is in its batch: its random stream
advances once per token it samples, never for another request.
"""

from __future__ import annotations

import torch

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams


def sample(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """logits [B, vocab] (fp32) -> next tokens [B] (int64, on the logits' device). A greedy request
    (temperature 0) takes the argmax; any other draws from its own adjusted distribution (sample_one),
    and from chapter 07 a draw that fails fails its own request alone."""
    # >>> ch19: a request with a grammar draws from the tokens it allows: the others' logits -inf, in a copy
    if any(req.grammar is not None for req in reqs):
        logits = mask_logits(logits, reqs)
    # <<< ch19
    tokens = logits.argmax(dim=-1)
    # >>> ch07 replaces ch03: a request whose sampling fails fails alone (its token, the argmax, is never used)
    #| for i, req in enumerate(reqs):
    #|     if req.params.temperature > 0:
    #|         tokens[i] = sample_one(logits[i], req)
    for i, req in enumerate(reqs):
        if req.params.temperature > 0:
            tokens[i] = fail_alone(req, sample_one, logits[i], req, default=tokens[i])
    # <<< ch07
    return tokens


def sample_one(logits: torch.Tensor, req: Req) -> torch.Tensor:
    """One draw from the request's adjusted distribution, with its own generator if it is seeded. From
    chapter 18 none for a chunk of a prompt: its token is thrown away, and a draw would advance the
    generator, so that a seeded request's tokens would depend on how its prompt was chunked (and, with
    the prefix cache, on what was cached). vLLM rewinds the generator of such a request instead."""
    # >>> ch18: a chunk's token is never used: no draw (a chunk: a prompt laid out in part)
    if 0 < req.seq_len < len(req.prompt_ids):
        return logits.argmax()
    # <<< ch18
    return torch.multinomial(adjusted_probs(logits, req.params), 1, generator=req.generator)[0]


def adjusted_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p: the distribution a request samples from, for each row of
    logits [..., vocab] (one row here; from chapter 09 every position of a speculative window).

    The logits are shifted so that the largest is 0 before the division: a temperature so small that
    the quotients overflow (1e-45) then sends the others to -inf, never the top one to inf or NaN, and
    the draw is greedy, the limit of sampling as the temperature goes to 0. It is not refused, because
    where the division overflows depends on the logits, which no check of the parameters sees. The
    arithmetic is float64, where every temperature SamplingParams accepts and every top_p stays > 0
    (in float32, 1e-46 and 1e-300 round to 0, which would let top-p drop every token).
    """
    # >>> exercise 03.1: top-k and top-p sampling
    logits = (logits.double() - logits.max(dim=-1, keepdim=True).values) / p.temperature   # all <= 0, the top one 0
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs        # probability mass ranked above each token
        sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)   # the top token (0 above it) always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
    # <<< exercise 03.1


def make_generator(req: Req, device: torch.device) -> torch.Generator | None:
    """A generator of the request's own, seeded, or None to use torch's global one."""
    if req.params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(req.params.seed)
# >>> ch07: a request whose sampling fails fails alone


def fail_alone(req: Req, work, *args, default):
    """work(*args), or, if it raises, `default`, with the failure kept on the request: the scheduler
    ends that request alone, with finish_reason "error", when it handles the step. Its batch goes on."""
    try:
        return work(*args)
    except Exception as e:
        req.error = f"{type(e).__name__}: {e}"
        return default
# <<< ch07
# >>> ch19: grammar-constrained sampling


def mask_logits(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """logits [B, vocab] -> a copy in which each token a request's grammar forbids is -inf; the rows of
    free requests as they were. The mask is filled on the host from every token each request has taken:
    in the normal loop the step before has been handled when this one is launched; in the overlap loop
    the sample of a constrained step is put off until it has (ModelRunner.sample_later)."""
    from minioverlap.constrained.grammar import masked, token_bitmask   # xgrammar: see that module
    return masked(logits, token_bitmask(reqs, logits.shape[-1]))
# <<< ch19
