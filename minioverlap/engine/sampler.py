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
# >>> ch16: min_p; repetition_penalty and min_tokens, from what the device holds
import math

from minioverlap.cache.req_to_token import ReqToTokenPool
from minioverlap.device.transfer import to_device
from minioverlap.engine.forward_batch import ForwardBatch
# <<< ch16


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
    if req.seq_len > 0 and req.prefilling:
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
    # >>> ch16: min_p first, as vLLM's sampler applies it: top-k and top-p see only the tokens it keeps
    if p.min_p > 0:
        logits = min_p_masked(logits, p)
    # <<< ch16
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
    # >>> ch21: a retracted request keeps its own: its next draw is the one it would have made
    if req.generator is not None:
        return req.generator
    # <<< ch21
    if req.params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(req.params.seed)
# >>> ch16: min_p; repetition_penalty and min_tokens, from what the device holds


def min_p_masked(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] with -inf for each token whose probability after the temperature is below min_p
    times the top token's. In logits: p_i < min_p * p_max  <=>  (l_i - l_max) / T < log(min_p), so no softmax
    is needed, and the top token always stays. Greedy never comes here: min_p cannot change an argmax."""
    shifted = (logits.double() - logits.max(dim=-1, keepdim=True).values) / p.temperature
    return logits.masked_fill(shifted < math.log(p.min_p), float("-inf"))


def penalized(logits: torch.Tensor, batch: ForwardBatch, tables: ReqToTokenPool) -> torch.Tensor:
    """The logits a step's requests choose from, [B, vocab] or a verify's [B, W, vocab]: a copy with each
    request's repetition_penalty and min_tokens applied, or the logits themselves if none asks (greedy
    requests too: both change the argmax). The logprobs stay the model's.

    Both need a count that moves with every token, and in the overlap loop, or with MTP, the host's lags
    the device's. So both are computed from what the step itself knows on the device: the position each
    row ran at (the row at position pos chooses the token for pos + 1, the request's output token number
    pos + 1 - len(prompt): a verify's row j counts the drafts before it), and token_pool, which holds every
    token sampled (05) and, before a verify's rows, its drafts."""
    reqs = batch.reqs
    if all(r.params.repetition_penalty == 1 and r.params.min_tokens == 0 for r in reqs):
        return logits
    rows = logits.view(len(reqs), -1, logits.shape[-1])                 # [B, W, vocab]
    W, device = rows.shape[1], logits.device
    positions = batch.positions[batch.last_index[:, None] - (W - 1) + torch.arange(W, device=device)]   # [B, W]
    prompt_lens = to_device([len(r.prompt_ids) for r in reqs], torch.int64, device)[:, None]
    made = positions + 1 - prompt_lens                                  # [B, W] output tokens before each row's
    if any(r.params.repetition_penalty != 1 for r in reqs):
        rows = repetition_penalized(rows, batch, prompt_lens, made, tables)
    if any(r.params.min_tokens for r in reqs):
        rows = stops_masked(rows, reqs, made)
    return rows.view(logits.shape)


def repetition_penalized(rows: torch.Tensor, batch: ForwardBatch, prompt_lens: torch.Tensor, made: torch.Tensor,
                         tables: ReqToTokenPool) -> torch.Tensor:
    """rows [B, W, vocab], prompt_lens [B, 1], made [B, W] -> each token the request has seen, its prompt or
    its first `made` output tokens: its logit divided by the penalty if positive, multiplied if not (CTRL's
    rule, as transformers, vLLM and SGLang apply it). The outputs are read from token_pool (positions
    P .. P+made-1); the prompt from a mask of its own, made once: a prompt the prefix cache served was never
    written to token_pool whole (its prefill runs only the rest), so its first positions there hold another
    request's tokens. A request without a penalty (1) is left as it is, whatever it has seen."""
    vocab = rows.shape[-1]
    pool = tables.read_outputs(batch, [len(r.prompt_ids) for r in batch.reqs])     # [B, L]
    index = (torch.arange(pool.shape[1], device=rows.device) - prompt_lens)[:, None, :]   # [B, 1, L]: output token number
    counted = (index >= 0) & (index < made[:, :, None])                 # [B, W, L]
    tokens = torch.where(counted, pool[:, None, :].long(), 0)
    seen = torch.zeros_like(rows).scatter_add_(2, tokens, counted.to(rows.dtype)) > 0
    seen |= torch.stack([prompt_mask(r, vocab, rows.device) for r in batch.reqs])[:, None, :]
    penalty = to_device([r.params.repetition_penalty for r in batch.reqs], rows.dtype, rows.device)[:, None, None]
    return torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)


def prompt_mask(req: Req, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] True at each token of the request's prompt, on the device, made at its first penalized step
    (all False for a request without a penalty, which needs none)."""
    if req.params.repetition_penalty == 1:
        return torch.zeros(vocab, dtype=torch.bool, device=device)
    if req.prompt_seen is None:
        ids = to_device(sorted(set(req.prompt_ids)), torch.int64, device)
        req.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
    return req.prompt_seen


def stops_masked(rows: torch.Tensor, reqs: list[Req], made: torch.Tensor) -> torch.Tensor:
    """rows [B, W, vocab], made [B, W] -> -inf at each stop token (EOS unless ignore_eos, stop_token_ids) in
    each row that chooses one of the request's first min_tokens tokens: vLLM's MinTokensLogitsProcessor."""
    B, _, vocab = rows.shape
    cells = [i * vocab + t for i, r in enumerate(reqs) if r.params.min_tokens for t in sorted(r.stop_ids)]
    if not cells:
        return rows
    stops = torch.zeros(B * vocab, dtype=torch.bool, device=rows.device)
    stops = stops.scatter_(0, to_device(cells, torch.int64, rows.device), True).view(B, vocab)   # True a scalar: no host copy
    early = made < to_device([r.params.min_tokens for r in reqs], torch.int64, rows.device)[:, None]   # [B, W]
    return rows.masked_fill(early[:, :, None] & stops[:, None, :], float("-inf"))
# <<< ch16
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
    the sample of a constrained step is put off until it has (ModelRunner.sample_later). A request that
    has finished has a free row (the overlap loop launched it once more, chapter 07: its token is dropped);
    one whose grammar allows no token fails alone (chapter 07), its row free."""
    from minioverlap.constrained.grammar import masked, token_bitmask   # xgrammar: see that module
    bitmask, stuck = token_bitmask(live_grammars(reqs), logits.shape[-1])
    for i in stuck:
        reqs[i].error = "its grammar allows no token of the vocabulary"
    return masked(logits, bitmask)


def live_grammars(reqs: list[Req]) -> list:
    """Each request's grammar, None for a free request or one that has finished."""
    return [None if req.finished else req.grammar for req in reqs]
# <<< ch19
