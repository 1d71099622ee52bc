# >>> ch16 file: logprobs, computed with the sample and copied with the tokens
"""Log-probabilities of the tokens a step chooses, and of the most likely ones, for the requests that ask.

They are computed on the device, in the step that samples the tokens, from the same logits, and start
on their way to the host before the tokens' copy: the copy-done event the scheduler waits on before it
handles the step covers them too. Computing them later, when the step is handled, would be wrong in the
overlap loop: by then the next step has been launched, and whatever the runner holds is that step's
(SGLang's overlap scheduler met this bug; its #1795 queues the logprobs' copy before the same copy-done event).

They are the model's raw distribution, log_softmax of the target's logits at that position: before the
temperature, top-k and top-p that a sampled request draws from (what vLLM returns by default). With MTP
the verify pass's logits give each accepted token's (and the bonus token's) from its own row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minioverlap.device.transfer import to_host
from minioverlap.sampling_params import SamplingParams


class Req(Protocol):
    """What this module reads of a request (engine/request.py's Req, which holds its TokenLogprobs and
    so imports this module): its sampling parameters."""
    params: SamplingParams


@dataclass
class TokenLogprob:
    """One token's log-probability, and the most likely tokens at its position with theirs, best first."""
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class StepLogprobs:
    """A step's logprobs, each request's window of W positions: on the device, and on the host once the
    step's copy-done event has completed. The device tensors stay alive until then (as StepOutput's)."""
    chosen: torch.Tensor                 # [B, W] the log-probability of each window token
    top_values: torch.Tensor             # [B, W, K] the K largest log-probabilities (K: the batch's largest ask)
    top_ids: torch.Tensor                # [B, W, K] their tokens
    on_device: tuple[torch.Tensor, ...]  # the same three on the device

    def lists(self, accept_lens: list[int], reqs: list[Req]) -> list[list[TokenLogprob] | None]:
        """Each request's TokenLogprobs of its accepted tokens, its own top k of them; None for a request
        that did not ask."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return [None if req.params.logprobs is None else
                [TokenLogprob(chosen[i][j], list(zip(ids[i][j], values[i][j]))[:req.params.logprobs]) for j in range(n)]
                for i, (req, n) in enumerate(zip(reqs, accept_lens))]


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Req]) -> StepLogprobs | None:
    """logits [B, W, vocab] and the tokens chosen from them [B, W] -> their logprobs, on their way to the
    host; None, at no cost, when no request of the batch asks."""
    asked = [req.params.logprobs for req in reqs if req.params.logprobs is not None]
    if not asked:
        return None
    logprobs = logits.float().log_softmax(dim=-1)      # the raw distribution: no temperature, top-k or top-p
    chosen = logprobs.gather(-1, tokens[..., None].long())[..., 0]
    top = logprobs.topk(max(asked), dim=-1)
    on_device = chosen, top.values, top.indices
    return StepLogprobs(*(to_host(t)[0] for t in on_device), on_device)
