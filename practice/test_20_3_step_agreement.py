# >>> ch20 file: the judge's own test of exercise 20.3
"""Exercise 20.3, judged in one process: the agreement before a step, under DP attention.

Each rank has scheduled its own batch (or none), and every layer's MLP will gather every rank's rows padded
to one count. So before the step the ranks tell each other how many tokens each will run, and each pads to
the largest (DPScheduler.agree). Here the scheduler is rank 0 of two; the group is a fake whose
all_gather_ints returns what this rank gave and, for rank 1, a prepared count, and keeps what this rank
gave. The model's set_max_tokens is a recorder. No process starts.

    python practice/judge.py test 20.3
"""

from __future__ import annotations

import pytest

from minioverlap import LLM, SamplingParams
from minioverlap.parallel.dp_scheduler import DPScheduler

PROMPTS = ["def fibonacci(n):", [5, 6, 7]]


class FakeGroup:
    """Rank 0 of two: all_gather_ints gives [this rank's values, rank 1's prepared ones] and records the call."""

    tp_rank, tp_size = 0, 2

    def __init__(self, *theirs: int) -> None:
        self.theirs, self.given = list(theirs), []

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        self.given.append(list(values))
        return [list(values), [self.theirs.pop(0)]]


@pytest.fixture
def llm():
    return LLM(overlap=False)


def rank0(llm: LLM, *theirs: int) -> DPScheduler:
    """A DP scheduler over the engine's runner, rank 0 of a fake group of two; set_max_tokens recorded."""
    scheduler = DPScheduler(llm.runner, FakeGroup(*theirs))
    scheduler.chunked_prefill_size = llm.scheduler.chunked_prefill_size
    scheduler.set_to = []
    llm.runner.model.set_max_tokens = scheduler.set_to.append
    return scheduler


def prefill(scheduler: DPScheduler, llm: LLM, prompts=PROMPTS):
    """This rank's own batch: the prompts' prefill, scheduled as Scheduler does it."""
    scheduler.submit(llm.make_requests(prompts, SamplingParams(max_tokens=4)))
    scheduler.receive()
    with llm.runner.schedule_stream():
        return super(DPScheduler, scheduler).schedule()


def test_the_rank_gives_its_step_s_token_count(llm):
    scheduler = rank0(llm, 2)
    batch = prefill(scheduler, llm)
    scheduler.agree(batch)
    tokens = sum(len(llm.encode(p)) for p in PROMPTS)
    assert scheduler.group.given == [[tokens]], \
        f"one exchange, of one integer: the tokens this rank's step runs (every prompt row: {tokens})"


def test_a_rank_without_a_batch_gives_0(llm):
    scheduler = rank0(llm, 3)
    assert scheduler.agree(None) == 3
    assert scheduler.group.given == [[0]], "a rank with no batch still takes part in the exchange, with 0"


@pytest.mark.parametrize("theirs", [1, 40], ids=["ours-larger", "theirs-larger"])
def test_the_answer_is_the_largest_count_and_the_model_pads_to_it(llm, theirs):
    scheduler = rank0(llm, theirs)
    batch = prefill(scheduler, llm)
    ours = sum(batch.extend_lens)
    assert scheduler.agree(batch) == max(ours, theirs)
    assert scheduler.set_to == [max(ours, theirs)], "the model is told the step's count before its forward"


def test_no_rank_has_a_step(llm):
    scheduler = rank0(llm, 0)
    assert scheduler.agree(None) == 0, "every count is 0: no rank runs a step"
    assert scheduler.set_to == [] and not [e for e in scheduler.trace if e.kind == "agree"], \
        "no step: the model is not told, and no agreement is recorded"


def test_an_agree_event_records_every_rank_s_count_for_the_coming_step(llm):
    scheduler = rank0(llm, 5, 7)
    batch = prefill(scheduler, llm)
    scheduler.agree(batch)
    scheduler.agree(None)
    agreed = [(e.step, e.uids) for e in scheduler.trace if e.kind == "agree"]
    ours = sum(batch.extend_lens)
    assert agreed == [(1, (ours, 5)), (2, (0, 7))], \
        ("the step a scheduled batch has (self.step), or the next one for a rank without one (its empty "
         f"batch is counted then), with the counts in rank order: {agreed}")
