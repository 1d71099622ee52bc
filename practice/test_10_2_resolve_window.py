# >>> ch10 file: the judge's own test of exercise 10.2
"""Exercise 10.2, judged on the verify batches of a real engine: resolve_window lays each request's
window out from the committed lengths it is given.

The engine runs one prefill step for its prompts (launched and waited for; its tokens are not handled
here, none is needed): the relay holds each request's committed length L, req_to_token the KV slots of
every position the request may reach. The host then builds the verify batch, which holds request slots
and no positions, and resolve_window must give a new batch whose window of request i is positions
L_i .. L_i + k (request by request), its KV slots req_to_token's at those positions in the request's own
row, and its lengths L_i + k + 1, computed on the device from the lengths it was given, whatever the
host counts.

    python practice/judge.py test 10.2
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from minioverlap import LLM, SamplingParams
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.request import Req
from minioverlap.speculative.verify_batch import resolve_window

PROMPTS = ["def fibonacci(n):", [5, 6, 7], "import os\n\ndef list_files(path):"]


def prefilled(k: int, prompts: list) -> tuple[LLM, list[Req], ForwardBatch]:
    """An engine of k drafts whose prompts' prefill has run, and the verify batch the host builds next."""
    llm = LLM(overlap=False, mtp_steps=k)
    reqs = llm.make_requests(prompts, SamplingParams(max_tokens=40))
    scheduler = llm.scheduler
    for req in reqs:
        scheduler.add_request(req)
    scheduler.receive()
    out = scheduler.launch(scheduler.schedule())
    scheduler.wait(out)
    return llm, reqs, llm.runner.batch(ForwardMode.DECODE, reqs)


def committed(llm: LLM, batch: ForwardBatch) -> torch.Tensor:
    """The relay's committed length of each request of the batch, [B] on the device."""
    return llm.runner.relay.new_seq_lens[batch.req_pool_indices]


def test_each_window_is_k_plus_1_positions_from_its_committed_length_request_by_request():
    """Three requests of different lengths, k = 3: positions L..L+3 of each, one request after the other;
    their KV slots req_to_token's in the request's row (those its pages give, chapter 02's kv_slots);
    lengths L + 4. The batch the host built is left as it was: resolve_window gives a new one."""
    k = 3
    llm, reqs, batch = prefilled(k, PROMPTS)
    tables, allocator = llm.runner.tables, llm.runner.allocator
    lens = [len(req.prompt_ids) for req in reqs]
    assert committed(llm, batch).tolist() == lens
    window = resolve_window(batch, committed(llm, batch), tables)
    assert window is not batch and batch.positions is None and batch.out_cache_loc is None
    assert window.positions.tolist() == [p for L in lens for p in range(L, L + k + 1)]
    assert window.out_cache_loc.tolist() == [s for req, L in zip(reqs, lens)
                                             for s in tables.req_to_token[req.row, L:L + k + 1].tolist()]
    assert window.out_cache_loc.tolist() == [s for req, L in zip(reqs, lens)
                                             for s in allocator.kv_slots(req.pages, L, L + k + 1)]
    assert window.seq_lens.tolist() == [L + k + 1 for L in lens]
    assert window.req_pool_indices.tolist() == batch.req_pool_indices.tolist()


def test_the_window_starts_at_the_lengths_given_not_at_the_host_s_count():
    """The lengths handed in rule, not req.seq_len: given L + 2 for one request and L for the other, k = 2,
    the first's window is L+2 .. L+4, at req_to_token's slots there, with L + 5 keys."""
    k = 2
    llm, reqs, batch = prefilled(k, PROMPTS[:2])
    tables = llm.runner.tables
    lens = [len(req.prompt_ids) for req in reqs]
    given = committed(llm, batch) + torch.tensor([2, 0], device=batch.req_pool_indices.device)
    window = resolve_window(batch, given, tables)
    starts = [lens[0] + 2, lens[1]]
    assert window.positions.tolist() == [p for L in starts for p in range(L, L + k + 1)]
    assert window.out_cache_loc.tolist() == [s for req, L in zip(reqs, starts)
                                             for s in tables.req_to_token[req.row, L:L + k + 1].tolist()]
    assert window.seq_lens.tolist() == [L + k + 1 for L in starts]


class Reads(TorchFunctionMode):
    """The calls that read a tensor's values back to the host: on a GPU, each waits for the device."""

    READS = {"tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__", "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (name := getattr(func, "__name__", str(func))) in self.READS:
            self.reads.append(f"{name}()")
        return func(*args, **(kwargs or {}))


def test_the_window_is_laid_out_on_the_device():
    """resolve_window reads nothing back to the host: no .tolist(), .item(), int() or .cpu() of the
    lengths or of the tables (the host does not know the lengths when the step runs: the device does)."""
    llm, reqs, batch = prefilled(3, PROMPTS)
    seq_lens = committed(llm, batch)
    with Reads() as calls:
        window = resolve_window(batch, seq_lens, llm.runner.tables)
    assert calls.reads == []
    assert window.positions.shape == (len(reqs) * 4,)
