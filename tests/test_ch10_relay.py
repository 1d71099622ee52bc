"""Chapter 10: the relay. A speculative step hands its outcome to the next one on the device, in per-slot
buffers; the next step gets slot numbers from the host and lays its window out from the relay."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import run_example
from minioverlap import LLM, SamplingParams
from minioverlap.device.hazard import HazardChecker, HazardError
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.speculative.relay import Relay

PROMPTS = ["def fibonacci(n):", [5, 6, 7], "import os\n\ndef list_files(path):", [9] * 20, "class Stack:"]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(overlap=False)
    return [o.token_ids for o in llm.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in (12, 1, 30, 7, 19)])]


def started(k: int = 3, **options) -> tuple[LLM, list]:
    """An engine with one prompt past its prefill (the relay holds its row) and the next decode batch built."""
    llm = LLM(overlap=False, mtp_steps=k, **options)
    [req] = llm.make_requests(["def fibonacci(n):"], SamplingParams(max_tokens=40))
    llm.scheduler.add_request(req)
    llm.scheduler.normal_loop()                   # the prefill: publishes L, stashes the first draft
    return llm, [req]


def test_a_verify_batch_from_the_host_holds_slot_numbers_only():
    """What the host builds for a speculative decode step has the request slots (and the KV slots it
    reserved in req_to_token) but no positions, KV slots, lengths or drafter inputs: those the step
    reads from the relay, on the device, when it runs."""
    llm, [req] = started()
    batch = llm.runner.batch(ForwardMode.DECODE, [req])
    assert batch.mode is ForwardMode.TARGET_VERIFY and batch.req_pool_indices.tolist() == [req.row]
    assert batch.positions is None and batch.out_cache_loc is None and batch.seq_lens is None
    assert not hasattr(batch, "draft_inputs")


def test_resolve_lays_the_window_out_from_the_relay():
    """The window of a request with committed length L (the relay's new_seq_lens, = the prompt's length
    after the prefill) is positions L..L+k, at the KV slots req_to_token holds for them, with L+k+1 keys
    visible; the drafter gets the relay's draft token and hidden state of the request's slot."""
    k = 3
    llm, [req] = started(k)
    relay, tables = llm.runner.relay, llm.runner.tables
    L = len(req.prompt_ids)
    assert relay.new_seq_lens[req.row].item() == L == req.seq_len
    batch = llm.runner.batch(ForwardMode.DECODE, [req])
    built = batch
    batch, (draft, hidden) = llm.runner.resolve(batch)
    assert built.positions is None, "the batch the host built is left as it is: resolve gives a new one"
    assert batch.positions.tolist() == list(range(L, L + k + 1))
    assert batch.out_cache_loc.tolist() == tables.req_to_token[req.row, L:L + k + 1].tolist()
    assert batch.out_cache_loc.tolist() == llm.runner.allocator.kv_slots(req.pages, L, L + k + 1)
    assert batch.seq_lens.tolist() == [L + k + 1]
    assert draft.tolist() == [relay.draft_token[req.row].item()]
    assert torch.equal(hidden[0], relay.hidden[req.row])


def test_the_relay_publishes_the_length_the_host_commits():
    """After every handled step, each running request's row of new_seq_lens equals the length the host
    committed when it handled the step's accepted tokens (in the normal loop the host is never behind)."""
    llm = LLM(overlap=False, mtp_steps=2, max_running=3)
    for req in llm.make_requests(PROMPTS, SamplingParams(max_tokens=25)):
        llm.scheduler.add_request(req)
    checked = 0
    while llm.scheduler.busy:
        llm.scheduler.normal_loop()
        for req in llm.scheduler.running:
            assert llm.runner.relay.new_seq_lens[req.row].item() == req.seq_len
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("k,page_size,max_running", [(1, 1, 1), (2, 4, 2), (4, 16, 3)])
def test_tokens_equal_plain_greedy_with_slots_reused(plain, k, page_size, max_running):
    """With fewer request slots than prompts, slots are reused: a new owner of a slot reads its own
    relay row (its prefill wrote it), never the previous owner's. Every prompt's tokens equal plain
    greedy's, and nothing is leaked."""
    llm = LLM(overlap=False, mtp_steps=k, page_size=page_size, max_running=max_running)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in (12, 1, 30, 7, 19)])
    assert [o.token_ids for o in outs] == plain
    llm.check_integrity()


def test_slot_zero_is_the_padding_sink_no_request_touches():
    """Row 0 of the relay belongs to no request: after a run that used every slot, it is still zero."""
    llm = LLM(overlap=False, mtp_steps=3, max_running=2)
    llm.generate(PROMPTS, SamplingParams(max_tokens=10))
    relay = llm.runner.relay
    assert relay.new_seq_lens[0].item() == 0 and relay.draft_token[0].item() == 0
    assert not relay.hidden[0].any()
    assert relay.new_seq_lens[1:].any()


def test_the_checker_sees_the_relay():
    """The relay's buffers are shared tables: a read on the schedule stream of a row the forward stream
    published raises HazardError naming the buffer, unless the schedule stream waited for it."""
    hazards = HazardChecker()
    relay = Relay(3, 4, torch.float32, "cpu", hazards)
    slots = torch.tensor([1])
    hazards.current = "forward"
    relay.publish(slots, [1], torch.tensor([7]))
    hazards.current = "schedule"
    with pytest.raises(HazardError, match="relay.new_seq_lens row 1"):
        relay.read(slots, [1])
    hazards.wait_stream("forward")
    relay.read(slots, [1])


def test_defaults_are_silent_with_the_relay():
    """A speculative run with the hazard checker on, the defaults in place, raises nothing."""
    llm = LLM(overlap=False, mtp_steps=3, max_running=2, hazard_check=True)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=15))
    assert all(o.finish_reason for o in outs)
    llm.check_integrity()


@pytest.mark.process
def test_the_example_hands_the_step_slot_numbers_and_the_step_finds_its_window():
    """`python examples/ch10_relay.py`: what the host hands over has request slots and no positions; after
    resolve, each slot's positions start at its relay row's new_seq_lens."""
    out = run_example("examples/ch10_relay.py")
    assert re.search(r"req_pool_indices\s+\[1, 2\]", out) and re.search(r"positions\s+None", out)
    lens = [int(m) for m in re.findall(r"│ [12]\s+│ [01]\s+│ (\d+)\s+│", out)]
    starts = [int(m) for m in re.findall(r"slot [12]: \[(\d+),", out.split("lays its window out")[1])][:2]
    assert len(lens) == 2 and starts == lens
