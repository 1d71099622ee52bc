# >>> ch21 file: the judge's own test of exercise 21.2
"""Exercise 21.2, judged on plain requests: the pages admission counts a request for, beyond those it holds.

growth_pages(pages_for, req, tokens_needed, ratio): req has laid out req.seq_len tokens (a cached prefix,
earlier chunks, its decode steps) and must lay out at least what it fills (req.fill_len: its prompt, and
after a retraction its outputs too); tokens_needed is every position it may ever hold (prompt and
max_tokens, with MTP its windows' reach). Of the tokens between, it is counted for `ratio` of them (at most
CLIP_MAX_NEW_TOKENS), rounded up; the answer is the pages of all that, less the pages it holds already,
and never below 0.

    python practice/judge.py test 21.2
"""

from __future__ import annotations

import math

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams
from minioverlap.scheduler.retraction import CLIP_MAX_NEW_TOKENS, growth_pages


def pages_for(tokens: int) -> int:
    return math.ceil(tokens / 4)


def request(prompt_len: int, seq_len: int = 0, pages: int = 0, outputs: int = 0, recomputed: int = 0) -> Req:
    req = Req(0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), max_new_tokens=64)
    req.seq_len, req.pages, req.output_ids, req.recomputed = seq_len, list(range(1, pages + 1)), [5] * outputs, recomputed
    return req


def test_a_waiting_request_counts_its_prompt_and_a_share_of_its_tokens():
    assert growth_pages(pages_for, request(10), 10 + 63, 0.5) == pages_for(10 + 32)


def test_a_cached_prefix_is_held_already():
    assert growth_pages(pages_for, request(10, seq_len=8, pages=2), 73, 0.5) == pages_for(10 + 32) - 2


def test_a_running_request_counts_from_what_it_has_laid_out():
    assert growth_pages(pages_for, request(10, seq_len=30, pages=8, outputs=21), 73, 0.25) == pages_for(30 + 11) - 8


def test_a_retracted_request_fills_its_outputs_again():
    assert growth_pages(pages_for, request(10, outputs=12, recomputed=12), 73, 0.5) == pages_for(22 + 26)


def test_the_share_is_rounded_up_and_a_ratio_of_1_counts_every_token():
    assert growth_pages(pages_for, request(4), 4 + 1, 0.1) == pages_for(5)
    assert growth_pages(pages_for, request(10), 73, 1.0) == pages_for(73)


def test_the_growth_is_clipped():
    huge = 10 + 100_000
    assert growth_pages(pages_for, request(10), huge, 1.0) == pages_for(10 + CLIP_MAX_NEW_TOKENS)


def test_never_below_zero():
    assert growth_pages(pages_for, request(4, seq_len=8, pages=5), 9, 0.1) == 0
