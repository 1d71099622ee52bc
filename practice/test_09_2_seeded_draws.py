# >>> ch09 file: the judge's own test of exercise 09.2
"""Exercise 09.2, judged on what accept_sampled draws: exactly k coins and one token, from the request's
own generator, whatever the outcome.

A seeded request must draw the same tokens alone and in any batch. Its generator is its own, so the
other requests of a batch cannot move it; and what it draws at one step must not depend on how many
drafts were accepted, or the next step's draws would shift with the outcome. Here accept_sampled runs on
hand-made windows where every draft is accepted, where the first is rejected and where one in the middle
is, each from a generator of the same seed: afterwards the generators must stand at the same place, and
the global generator must not have moved.

    python practice/judge.py test 09.2
"""

from __future__ import annotations

import pytest
import torch

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams
from minioverlap.speculative.accept import accept_sampled

VOCAB = 6


def sampled_req(seed: int) -> Req:
    req = Req(0, [1], SamplingParams(max_tokens=8, temperature=1.0), 8)
    req.generator = torch.Generator().manual_seed(seed)
    return req


def window(k: int, rejected: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [k+1, VOCAB] and drafts [k] (draft j is token j + 1): each draft certain up to `rejected`,
    that one impossible (its row allows tokens 0 and 5 only); None: all accepted."""
    drafts = torch.arange(1, k + 1)
    logits = torch.full((k + 1, VOCAB), float("-inf"))
    logits[torch.arange(k), drafts] = 0.0
    logits[k] = 0.0                                          # the last row: any token
    if rejected is not None:
        logits[rejected] = float("-inf")
        logits[rejected, 0] = logits[rejected, 5] = 0.0
    return logits, drafts


@pytest.mark.parametrize("k", [1, 3])
def test_a_seeded_request_draws_as_much_whatever_the_drafts_accepted(k):
    """Every draft accepted, the first rejected, the last rejected: the accept lengths differ (k+1, 1, k),
    and the request's generator, seeded alike, stands at the same place after each."""
    states, lengths = [], []
    for rejected in (None, 0, k - 1):
        req = sampled_req(7)
        tokens, accept_len = accept_sampled(*window(k, rejected), req)
        lengths.append(int(accept_len))
        states.append(req.generator.get_state())
    assert lengths == [k + 1, 1, k]
    assert all(torch.equal(states[0], state) for state in states[1:]), \
        "the generator moved by a different amount for a different outcome"


def test_a_seeded_request_draws_from_its_own_generator_only():
    """The draws come from req.generator: the global generator stands where it stood, and two requests
    of the same seed give the same window, with other draws in between."""
    logits, drafts = window(3, 1)
    logits[1] = 0.0                                          # row 1: any token but its draft after a rejection
    logits[0] = 0.0                                          # row 0: its draft with probability 1/6
    before = torch.get_rng_state()
    first = accept_sampled(logits, drafts, sampled_req(11))
    assert torch.equal(torch.get_rng_state(), before), "accept_sampled drew from the global generator"
    torch.rand(100)
    again = accept_sampled(logits, drafts, sampled_req(11))
    assert first[0].tolist() == again[0].tolist() and int(first[1]) == int(again[1])
