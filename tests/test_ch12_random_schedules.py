"""Chapter 12, everything at once: random schedules (arrivals, prompt lengths, max_tokens, stop tokens, EOS,
sampling, aborts at random points, small page pools, 1-4 request slots, k = 1..4). The overlap loop with
MTP gives every client exactly what the normal loop with MTP gives, which for greedy requests is plain
greedy's; nothing arrives after `finished`; integrity holds; the hazard checker is silent with the
defaults, and without the fence it names a race."""

from __future__ import annotations

import random

import pytest

from conftest import no_hang, sampled
from minioverlap import LLM, SamplingParams
from minioverlap.device.hazard import HazardError
from test_ch07_one_step_late import Plan, run_clients

SCHEDULES = 100
EVERY_STAGE = 10   # the first 10 schedules run in every later chapter's stage too; all 100 here and in the last


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def plain() -> LLM:
    """Plain greedy decoding in the normal loop, no drafter: the reference for greedy clients."""
    return LLM(overlap=False)


def schedule(seed: int) -> tuple[dict, list[Plan]]:
    """The engine (k, page size, pool, request slots) and the clients of random schedule `seed`."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    engine = dict(mtp_steps=rng.randint(1, 4), page_size=page_size, max_running=rng.randint(1, 4), max_seq_len=64,
                  num_pages=64 // page_size * rng.randint(1, 3) + 1)
    stops = [199, 8, 26, 279, 12, 9, 14]        # the tiny model's '\n', '(', ':', ' =', ',', ')', '.'
    plans = []
    for i in range(rng.randint(2, 5)):
        params = SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=tuple(rng.sample(stops, rng.randint(0, 2))),
                                temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randint(0, 999))
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(1, 24))]
        plans.append(Plan(prompt, params, arrive_after=0 if i < 2 else rng.randint(1, 10),
                          abort_after=rng.choice([None, None, rng.randint(1, 8)])))
    return engine, plans


@pytest.mark.parametrize("seed", sampled(list(range(SCHEDULES)), range(EVERY_STAGE)))
def test_random_schedule_overlap_equals_normal_equals_plain(seed, plain):
    """One random schedule in both loops with MTP (the overlap loop with the hazard checker on): the same
    tokens and finish reasons for every client, `finished` once, on the last reply; a greedy client gets
    plain greedy's tokens (a prefix of them if it aborted); integrity after each run."""
    engine, plans = schedule(seed)
    results = {}
    for overlap in (False, True):
        llm = LLM(overlap=overlap, hazard_check=overlap, **engine)
        with no_hang(120):
            results[overlap] = run_clients(llm, plans)
        llm.check_integrity()
        assert all(got.finish_reason is not None and got.replies_after_finish == 0 for got in results[overlap])
    assert results[True] == results[False]
    greedy = [(plan, got) for plan, got in zip(plans, results[True]) if plan.params.temperature == 0]
    if greedy:
        ref = plain.generate([plan.prompt for plan, _ in greedy], [plan.params for plan, _ in greedy])
        for (plan, got), want in zip(greedy, ref):
            if got.finish_reason == "abort":
                assert got.tokens == want.token_ids[:len(got.tokens)]
            else:
                assert (got.tokens, got.finish_reason) == (want.token_ids, want.finish_reason)


def test_without_the_fence_the_random_schedules_race():
    """The schedules are not too gentle to matter: with fence=False the checker raises on some of the
    first 20 with one or two request slots (a slot recycled while its previous owner's step runs)."""
    fired = 0
    for seed in range(20):
        engine, plans = schedule(seed)
        engine["max_running"] = min(engine["max_running"], 2)
        llm = LLM(overlap=True, hazard_check=True, fence=False, **engine)
        try:
            with no_hang(120):
                run_clients(llm, plans)
        except HazardError:
            fired += 1
    assert fired >= 3, f"only {fired} of 20 schedules raced without the fence"
