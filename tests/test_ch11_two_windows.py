"""Chapter 11: two windows. The host keeps each request's row reserved two windows (2(k+1) positions) past
its count of the request's committed length, so that a verify window lands on reserved slots even when
the device is a whole window ahead of that count (the overlap loop, chapter 12); admission counts the
reservation; a request that leaves gives back its whole reservation."""

from __future__ import annotations

import random
import re

import pytest

from conftest import no_hang, run_example, spec_overlap
from minioverlap import LLM, SamplingParams
from minioverlap.speculative.verify_batch import reservation_end

K = 3
W = K + 1                      # a window: the bonus token and k drafts


# ---- the arithmetic, by hand

def test_reservation_end_replays_figure_7():
    """Figure 7 of the GLM-5.3 overlap article (k = 3, windows of 4, a request at 100 tokens): before step 1
    the host counts 100 and reserves up to position 107; step 2 is built while step 1 runs, the count is
    still 100 and nothing new is reserved; step 3 is built after step 1 is handled (it accepted 3): count
    103, reserved up to 110; step 4 after step 2 (it accepted 4): count 107, up to 114."""
    last_reserved, kv_len = [], 0
    for count in (100, 100, 103, 107):
        kv_len = reservation_end(count, kv_len, W)
        last_reserved.append(kv_len - 1)
    assert last_reserved == [107, 107, 110, 114]


def test_reservation_end_never_shrinks():
    """A reservation already past two windows stays as it is; one short of them grows to exactly two
    windows past the count; a fresh row (kv_len 0) gets two windows from its count."""
    assert reservation_end(100, 120, W) == 120
    assert reservation_end(100, 107, W) == 108
    assert reservation_end(100, 108, W) == 108
    assert reservation_end(17, 0, 2) == 21
    assert reservation_end(17, 0, 1) == 19


def overlap_replay(start: int, accepts: list[int], reserve) -> list[tuple[int, int, int]]:
    """The overlap loop by hand: the device starts step i's window at the request's true length; the host
    builds step i knowing the outcomes of the steps before i-1 only (step i-1 is still in flight), and
    tops the row up with `reserve(count, kv_len, W)` first. -> (host count, last reserved, window end)."""
    lengths, kv_len, rows = [start], 0, []
    for a in accepts:
        lengths.append(lengths[-1] + a)
    for i in range(len(accepts)):
        count = lengths[max(i - 1, 0)]
        kv_len = reserve(count, kv_len, W)
        rows.append((count, kv_len - 1, lengths[i] + W - 1))
    return rows


def test_every_window_lies_within_the_reservation():
    """For 2000 random runs of accept lengths (1..k+1, runs of full windows included), every window of
    the overlap loop ends at or before the last reserved position, and the worst case ends exactly on
    it (Figure 7's step 3). With one window reserved, as chapter 09 does for the normal loop, a window
    runs past the reservation."""
    rng = random.Random(11)
    slack = []
    for _ in range(2000):
        accepts = [rng.choice([rng.randint(1, W), W]) for _ in range(rng.randint(1, 12))]
        for count, last, end in overlap_replay(rng.randint(1, 200), accepts, reservation_end):
            assert end <= last, f"a window ending at {end} past the reservation ({last}), accepts {accepts}"
            slack.append(last - end)
    assert min(slack) == 0
    one_window = overlap_replay(100, [3, 4, 1], lambda count, kv_len, w: max(kv_len, count + w))
    assert any(end > last for _, last, end in one_window)
    assert overlap_replay(100, [3, 4, 1], reservation_end) == [(100, 107, 103), (100, 107, 106), (103, 110, 110)]


# ---- the engine

def loops() -> list[bool]:
    """The loops that run MTP: the normal loop, and from chapter 12 the overlap loop."""
    return [False, True] if spec_overlap() else [False]


@pytest.mark.parametrize("overlap", loops())
def test_the_engines_windows_land_on_reserved_slots(overlap):
    """Every verify window of a real run (3 requests, 2 request slots, pages of 4) lies below the request's
    reserved end, on the KV slots of the request's own pages, and the host reserved exactly two windows
    past its count when it built the step. Found on the device, after the step laid the window out."""
    llm = LLM(overlap=overlap, mtp_steps=K, max_running=2, page_size=4, max_seq_len=128)
    runner, seen = llm.runner, []
    build, resolve = runner.batch, runner.resolve

    def built(mode, reqs):
        counts = [r.seq_len for r in reqs]
        batch = build(mode, reqs)
        seen.extend((count, r.kv_len) for count, r in zip(counts, reqs) if batch.extend_lens[0] == W)
        return batch

    def resolved(batch):
        batch, inputs = resolve(batch)
        positions = batch.positions.view(len(batch.reqs), W).tolist()
        loc = batch.out_cache_loc.view(len(batch.reqs), W).tolist()
        for req, pos, slots in zip(batch.reqs, positions, loc):
            assert pos[-1] < req.kv_len, f"request {req.uid}: window {pos} past its reservation {req.kv_len}"
            assert slots == runner.allocator.kv_slots(req.pages, pos[0], pos[-1] + 1)
        return batch, inputs

    runner.batch, runner.resolve = built, resolved
    with no_hang(60):
        outs = llm.generate(["def fibonacci(n):", "class Stack:", [5, 6, 7]], SamplingParams(max_tokens=40))
    assert seen and all(kv_len == count + 2 * W for count, kv_len in seen)
    assert all(o.token_ids for o in outs)
    llm.check_integrity()


@pytest.mark.parametrize("prompt_len, max_tokens, k, page_size", [(6, 10, 3, 1), (64, 128, 3, 16), (5, 3, 1, 4),
                                                                  (30, 31, 4, 8)])
def test_admission_counts_two_windows_past_the_last_token(prompt_len, max_tokens, k, page_size):
    """A request may hold its prompt, all but its last new token, and 2k+1 positions past that (two
    windows from a count of at most prompt + max_tokens - 2): pages_needed is that many positions in
    pages, computed here by hand."""
    llm = LLM(overlap=False, mtp_steps=k, page_size=page_size, max_seq_len=256)
    req = llm.make_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    positions = prompt_len + max_tokens - 1 + 2 * k + 1
    assert llm.runner.pages_needed(req) == -(-positions // page_size)


def test_two_requests_that_fit_the_pool_exactly_run_together_one_page_less_and_one_waits():
    """page_size 1, k = 3, prompt 6, max_tokens 10: each request may need 6 + 10 - 1 + 7 = 22 slots. A
    pool of 44 usable slots runs both at once; 43 runs them one after the other. Same tokens either way."""
    prompts, params = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], SamplingParams(max_tokens=10, ignore_eos=True)
    runs = {}
    for usable in (44, 43):
        llm = LLM(overlap=False, mtp_steps=K, page_size=1, num_pages=usable + 1, max_running=2, max_seq_len=64)
        most = 0
        with no_hang(60):
            for _ in llm.stream(prompts, params):
                most = max(most, len(llm.scheduler.running))
        runs[usable] = most
        llm.check_integrity()
    assert runs == {44: 2, 43: 1}


def test_a_request_that_leaves_gives_back_its_whole_reservation():
    """A request aborted in the middle of its run holds pages past its committed length (its reserved
    tail: two windows
    less what the last step accepted); once it leaves, every page and request slot is free again, and a finished one's too."""
    llm = LLM(overlap=False, mtp_steps=K, page_size=2, max_running=2, max_seq_len=128)
    runner, tails = llm.runner, []
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)]
    with no_hang(60):
        for reply in llm.stream(["def fibonacci(n):", "class Stack:"], params):
            req = next((r for r in llm.scheduler.running if r.uid == reply.uid), None)
            if req is not None and len(req.output_ids) >= 10:
                tails.append(len(req.pages) * 2 - req.seq_len)
                llm.abort(reply.uid)
    assert tails and tails[0] >= W, "the aborted request held at least a window of slots past its count"
    assert runner.free_pages == runner.usable_pages and runner.free_rows == 2
    llm.check_integrity()


@pytest.mark.parametrize("overlap", loops())
def test_a_request_that_fills_its_context_runs_to_its_last_token(overlap):
    """prompt + max_tokens = max_seq_len exactly, k = 3: the last windows reach 2k+1 positions past the
    context and the next bonus token one more; the request tables are that much wider, so the request
    runs to its last token and gives plain greedy's tokens."""
    prompt, params = list(range(40, 52)), SamplingParams(max_tokens=20, ignore_eos=True)
    llm = LLM(overlap=overlap, mtp_steps=K, page_size=1, max_seq_len=32)
    with no_hang(60):
        out = llm.generate([prompt], params)[0]
    assert out.token_ids == LLM(overlap=False, max_seq_len=32).generate([prompt], params)[0].token_ids
    assert len(out.token_ids) == 20
    llm.check_integrity()


@pytest.mark.process
def test_the_example_replays_figure_7():
    """`python examples/ch11_two_windows.py`: Figure 7 replayed with the engine's reservation_end under the
    overlap loop's lag gives the article's rows (the host counts 100, 100, 103, 107; the row is filled to
    107, 107, 110, 114; the windows start at 100, 103, 107, 108), the third window ends on the last
    reserved position, and every window of the real run's replay lies within its reservation."""
    out = run_example("examples/ch11_two_windows.py")
    figure = out.split("Figure 7")[1].split("a real run")[0]
    rows = re.findall(r"│ (\d+)\s+│ (\d+)\s+│ (\d+)\s+│ (\d+)-(\d+)\s+│ (\d+)\s+│ (\d+)\s+│", figure)
    assert [tuple(map(int, r)) for r in rows] == [
        # step, host's count, reserved up to (inclusive), window first-last, accepted, to spare
        (1, 100, 107, 100, 103, 3, 4),
        (2, 100, 107, 103, 106, 4, 1),
        (3, 103, 110, 107, 110, 1, 0),
        (4, 107, 114, 108, 111, 2, 3),
    ]
    assert "worst case: 0 to spare, at step 3" in figure
    assert out.rstrip().endswith("every window ended within the reservation (worst case: 0 positions to spare)")
