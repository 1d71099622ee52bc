# >>> ch21 file: the judge's own test of exercise 21.1
"""Exercise 21.1, judged on plain requests: the order in which a step short of pages takes requests back.

A request here is only its prompt and the output tokens it has received. The scheduler takes requests
back from the front of retraction_order's list until the others fit: the first is the one whose loss
costs least to recompute and frees the most, as SGLang chooses (ScheduleBatch.retract_decode): the
fewest output tokens first, and among as few, the longest prompt.

    python practice/judge.py test 21.1
"""

from __future__ import annotations

import random

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams
from minioverlap.scheduler.retraction import retraction_order


def request(uid: int, prompt_len: int, outputs: int) -> Req:
    req = Req(uid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), max_new_tokens=64)
    req.output_ids = [5] * outputs
    return req


def uids(reqs: list[Req]) -> list[int]:
    return [r.uid for r in reqs]


def test_the_fewest_output_tokens_go_first():
    reqs = [request(0, 10, 7), request(1, 10, 2), request(2, 10, 30), request(3, 10, 0)]
    assert uids(retraction_order(reqs)) == [3, 1, 0, 2]


def test_among_as_few_outputs_the_longest_prompt_goes_first():
    reqs = [request(0, 5, 4), request(1, 50, 4), request(2, 20, 4), request(3, 100, 9)]
    assert uids(retraction_order(reqs)) == [1, 2, 0, 3]


def test_the_list_given_is_not_changed():
    reqs = [request(0, 5, 4), request(1, 50, 1)]
    retraction_order(reqs)
    assert uids(reqs) == [0, 1], "the caller's list (the step's requests) must stay as it was"


def test_random_requests_come_in_order_of_outputs_then_prompt_length():
    rng = random.Random(21)
    for _ in range(50):
        reqs = [request(i, rng.randint(1, 40), rng.randint(0, 6)) for i in range(rng.randint(1, 12))]
        order = retraction_order(reqs)
        assert sorted(uids(order)) == uids(reqs), "every request once"
        keys = [(len(r.output_ids), -len(r.prompt_ids)) for r in order]
        assert keys == sorted(keys)
