# >>> ch07 file: the judge's own test of exercise 07.1
"""Exercise 07.1, judged over 100 random schedules: the overlap loop's clients receive exactly what
the normal loop's receive.

A schedule is two to five clients with random prompts, max_tokens, stop tokens and sampling, some
arriving while others stream and some aborting halfway, on a small engine whose request slots and
pages run short. For every schedule and every client, the overlap loop must deliver the same tokens
and finish reason as the normal loop, `finished` on the last reply and nothing after it; no request
slot or page may be handed out while a launched step still uses it; and at the end every slot and
page is free or owned exactly once. The engines are built once per shape and reused.

    python practice/judge.py test 07.1
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from minioverlap import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_ch07_one_step_late import Plan, Received, random_plans, run_clients, watched  # noqa: E402

SCHEDULES = 100
MAX_SEQ_LEN = 32
# (page_size, max_running, num_pages): one slot at a time; slots to spare but pages short; roomy.
SHAPES = [(1, 1, 33), (2, 2, 17), (4, 3, 17), (4, 4, 9), (16, 4, 9)]


@pytest.fixture(scope="module")
def engines():
    """One engine per shape and loop, with the slot-reuse watch installed. Small batches run fastest
    on one thread, and a schedule is a few short steps: one thread, for this test only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    built = {}
    for shape in SHAPES:
        page_size, max_running, num_pages = shape
        for overlap in (False, True):
            built[shape, overlap] = watched(overlap=overlap, max_seq_len=MAX_SEQ_LEN, page_size=page_size,
                                            max_running=max_running, num_pages=num_pages)
    yield built
    torch.set_num_threads(threads)


def random_schedule(rng: random.Random, stops: list[int]) -> list[Plan]:
    """Smaller than chapter 07's: up to 5 clients, 8 tokens, 12-token prompts."""
    return random_plans(rng, stops, clients=5, max_tokens=8, prompt_len=12, arrive=8, abort=4)


def serve(llm: LLM, violations: list[str], plans: list[Plan], where: str) -> list[Received]:
    got = run_clients(llm, plans)
    assert violations == [], f"{where}: {violations[0]}"
    llm.check_integrity()
    for k, client in enumerate(got):
        assert client.finish_reason is not None, f"{where}: client {k} never got a reply with finished=True"
        assert client.replies_after_finish == 0, (f"{where}: client {k} got {client.replies_after_finish} "
                                                  f"replies after the one with finished=True")
    return got


def test_overlap_equals_normal_over_100_random_schedules(engines):
    stops = [engines[SHAPES[0], False][0].encode(s)[0] for s in ("\n", "(", " =", ":", ",")]
    for seed in range(SCHEDULES):
        rng = random.Random(seed)
        shape = rng.choice(SHAPES)
        plans = random_schedule(rng, stops)
        got = {overlap: serve(*engines[shape, overlap], plans,
                              f"schedule {seed} ({'overlap' if overlap else 'normal'} loop)")
               for overlap in (False, True)}
        for k, (normal, overlap) in enumerate(zip(got[False], got[True])):
            assert overlap == normal, (
                f"schedule {seed} (page_size, max_running, num_pages = {shape}), client {k} "
                f"({plans[k].params.max_tokens} max_tokens, stop tokens {list(plans[k].params.stop_token_ids)}, "
                f"abort after {plans[k].abort_after}):\n  normal loop:  {normal}\n  overlap loop: {overlap}")
