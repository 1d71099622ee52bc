# >>> ch18 file: the judge's own test of exercise 18.1
"""Exercise 18.1, judged on plain requests: the budget hands out the chunks the scheduler would lay out.

A request here is only its prompt and its seq_len (the tokens already laid out: a cached prefix, earlier
chunks). The scheduler makes a TokenBudget for each step, gives it to the requests in order (the prompt
begun first, then the waiting ones) while it is not spent, and the runner lays out each one's chunk,
req.chunk_len(). The tests do the same, and require of every chunk: the rest of its prompt past seq_len,
or what is left of the step's budget if that is less; nothing counted twice; never more tokens a step
than the budget's size, decode rows included.

    python practice/judge.py test 18.1
"""

from __future__ import annotations

import random

import pytest

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams
from minioverlap.scheduler.budget import TokenBudget


def request(prompt_len: int, seq_len: int = 0, uid: int = 0) -> Req:
    """A request of prompt_len tokens whose first seq_len are laid out already."""
    return Req(uid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), max_new_tokens=4,
               seq_len=seq_len)


def hand_out(budget: TokenBudget, reqs: list[Req]) -> list[int]:
    """The scheduler's order: each request in turn takes its chunk while the budget is not spent; the
    chunks of those that joined the step (the others get none)."""
    chunks = []
    for req in reqs:
        if budget.spent:
            break
        budget.take(req)
        chunks.append(req.chunk_len())
    return chunks


def test_no_budget_gives_each_request_the_rest_of_its_prompt():
    budget = TokenBudget(None)
    assert hand_out(budget, [request(100), request(7), request(4096), request(1)]) == [100, 7, 4096, 1]
    assert not budget.spent, "a step without a budget is never full"


def test_a_prompt_longer_than_the_budget_gets_what_is_left_and_the_next_gets_nothing():
    budget = TokenBudget(8)
    assert hand_out(budget, [request(20), request(5)]) == [8], "the first takes all 8, the second must wait"
    assert budget.spent

    budget = TokenBudget(8)
    assert hand_out(budget, [request(8), request(5)]) == [8], "a prompt of exactly 8 spends the budget"
    assert budget.spent

    budget = TokenBudget(8)
    assert hand_out(budget, [request(3)]) == [3]
    assert not budget.spent, "5 of 8 tokens are left for the next request"


def test_a_cached_prefix_or_earlier_chunks_are_not_counted_again():
    """seq_len tokens are laid out already: a cached prefix (chapter 17) or the chunks of earlier steps."""
    assert hand_out(TokenBudget(None), [request(30, seq_len=12), request(9, seq_len=8)]) == [18, 1]
    budget = TokenBudget(100)
    assert hand_out(budget, [request(30, seq_len=12)]) == [18]
    assert hand_out(budget, [request(100, seq_len=40)]) == [60]
    assert hand_out(budget, [request(50, seq_len=10)]) == [22], "100 - 18 - 60 = 22 tokens were left"
    assert budget.spent

    req, size, chunks = request(45, seq_len=8), 16, []      # a prompt over several steps, as the engine runs it
    while req.seq_len < len(req.prompt_ids):
        [chunk] = hand_out(TokenBudget(size), [req])
        chunks.append(chunk)
        req.seq_len += chunk                                  # what the runner lays out
    assert chunks == [16, 16, 5], f"37 tokens past a cached prefix of 8, chunks of at most 16: got {chunks}"


def test_a_mixed_step_s_decode_rows_are_taken_first():
    """Each running request of a mixed step decodes one token in it: TokenBudget(size, decode_rows)."""
    budget = TokenBudget(10, decode_rows=3)
    assert hand_out(budget, [request(5), request(20), request(4)]) == [5, 2], "10 tokens, 3 of them decode rows"
    assert budget.spent

    budget = TokenBudget(10, decode_rows=10)
    assert budget.spent and hand_out(budget, [request(5)]) == [], "the decode rows fill the step"


def test_several_requests_share_the_budget_in_order():
    budget = TokenBudget(16)
    reqs = [request(5, uid=0), request(7, uid=1), request(10, uid=2), request(3, uid=3)]
    assert hand_out(budget, reqs) == [5, 7, 4], "5 + 7 whole, the third gets the 4 left, the fourth waits"
    assert budget.spent


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_lay_out_every_prompt_whole_in_chunks_within_the_budget(seed):
    """Random prompts (some with a cached prefix) run to their end, a step at a time, as the scheduler runs
    them: the prompts begun first, then the waiting ones in order, while the budget lasts. Every step runs
    exactly min(size, decode rows + the prompt tokens waiting) tokens, in order, and each prompt is laid
    out once, whole."""
    rng = random.Random(1800 + seed)
    size = rng.choice([1, 3, 16, 64])
    waiting = [request(rng.randint(1, 150), uid=uid) for uid in range(rng.randint(1, 8))]
    for req in waiting:
        req.seq_len = rng.choice([0, 0, rng.randint(0, len(req.prompt_ids) - 1)])
    todo = {req.uid: len(req.prompt_ids) - req.seq_len for req in waiting}
    running: list[Req] = []
    for step in range(1000):
        if not waiting and not any(r.seq_len < len(r.prompt_ids) for r in running):
            break
        decode_rows = rng.randint(0, size // 2)
        budget = TokenBudget(size, decode_rows)
        begun = [r for r in running if r.seq_len < len(r.prompt_ids)]
        order = begun + waiting
        want, left = [], size - decode_rows                  # a plain model of the step
        for req in order:
            if left <= 0:
                break
            want.append(min(len(req.prompt_ids) - req.seq_len, left))
            left -= want[-1]
        got = hand_out(budget, order)
        assert got == want, f"seed {seed}, step {step}: budget {size}, {decode_rows} decode rows, prompts " \
                            f"left {[len(r.prompt_ids) - r.seq_len for r in order]}: chunks {got}, not {want}"
        assert budget.spent == (left <= 0), f"seed {seed}, step {step}: spent is {budget.spent} with {left} left"
        for req, chunk in zip(order, got):
            req.seq_len += chunk
            todo[req.uid] -= chunk
            if req in waiting:
                waiting.remove(req)
                running.append(req)
    assert all(n == 0 for n in todo.values()), f"seed {seed}: prompt tokens never laid out: {todo}"
