# >>> ch18 file: the judge's own test of exercise 18.2
"""Exercise 18.2, judged on random ragged batches against a plain construction, one request at a time.

Each case is a batch of requests with random prefix lengths (0 included) and random new lengths (1
included), their KV slots scattered over a pool in pages, and a page table whose entries past each
request's length are stale: slots of other requests, as req_to_token's rows hold after earlier requests.
Every field of extend_indices must equal what a loop over the requests builds from the same lists and
table, and ragged_extend_attention through those indices must equal chapter 01's attention run on each
request alone (its queries at positions prefix .. prefix + n - 1). The indices must be built the same
way for one request or many (no loop over requests) and without reading anything back from the device.

    python practice/judge.py test 18.2
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minioverlap.engine.attention import extend_indices, ragged_extend_attention
from minioverlap.model.qwen3 import attention

DEVICE = os.environ.get("MINIOVERLAP_TEST_DEVICE", "cpu")   # as the chapters' tests (tests/conftest.py)
CASES = 30


def ragged_batch(seed: int, batch: int | None = None) -> tuple[list[int], list[int], torch.Tensor, int]:
    """prefix_lens, extend_lens, the page table [B, L] (int32, as req_to_token) and the pool's slots."""
    g = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))
    B = batch or randint(1, 7)
    prefix_lens = [randint(0, 40) * randint(0, 1) for _ in range(B)]          # about half of them 0
    extend_lens = [1 if randint(0, 2) == 0 else randint(1, 30) for _ in range(B)]
    page_size = [1, 2, 4][randint(0, 2)]
    ends = [p + n for p, n in zip(prefix_lens, extend_lens)]
    per_request = -(-max(ends) // page_size)
    slots = B * per_request * page_size
    table = torch.randint(0, slots, (B, max(ends) + randint(0, 9)), generator=g)   # stale past each end
    order = torch.randperm(B * per_request, generator=g).view(B, per_request)    # each request its own pages
    for b, end in enumerate(ends):
        pos = torch.arange(end)
        table[b, :end] = order[b][pos // page_size] * page_size + pos % page_size
    return prefix_lens, extend_lens, table.to(device=DEVICE, dtype=torch.int32), slots


def plain(prefix_lens: list[int], extend_lens: list[int], table: torch.Tensor) -> dict[str, object]:
    """Each field, built by a loop over the requests on the host."""
    rows = table.tolist()
    fields = {"qo_indptr": [0], "kv_indptr": [0], "kv_indices": [], "kv_batch": [], "kv_pos": []}
    for b, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
        fields["qo_indptr"].append(fields["qo_indptr"][-1] + n)
        fields["kv_indptr"].append(fields["kv_indptr"][-1] + prefix + n)
        for pos in range(prefix + n):
            fields["kv_indices"].append(rows[b][pos])
            fields["kv_batch"].append(b)
            fields["kv_pos"].append(pos)
    fields["max_extend"] = max(extend_lens)
    fields["max_kv"] = max(p + n for p, n in zip(prefix_lens, extend_lens))
    return fields


@pytest.mark.parametrize("seed", range(CASES))
def test_each_field_equals_a_plain_construction_per_request(seed):
    prefix_lens, extend_lens, table, _ = ragged_batch(18200 + seed)
    ix = extend_indices(prefix_lens, extend_lens, table)
    where = f"prefix_lens {prefix_lens}, extend_lens {extend_lens}"
    for name, want in plain(prefix_lens, extend_lens, table).items():
        got = getattr(ix, name)
        if isinstance(want, int):
            assert isinstance(got, int) and got == want, f"{where}: {name} is {got!r}, not {want}"
            continue
        assert isinstance(got, torch.Tensor) and got.device == table.device, \
            f"{where}: {name} must be a tensor on the page table's device ({table.device})"
        assert not got.is_floating_point(), f"{where}: {name} is {got.dtype}: indices are integers"
        assert got.tolist() == want, f"{where}: {name} is {got.tolist()}, not {want}"


def test_the_edges_one_request_prefixes_of_0_and_new_parts_of_1():
    table = torch.arange(40, dtype=torch.int32).view(4, 10).to(DEVICE)
    edges = [([0], [1]), ([9], [1]), ([0, 0, 0, 0], [1, 1, 1, 1]), ([3, 0, 8, 0], [1, 2, 1, 10])]
    for prefix_lens, extend_lens in edges:
        rows = table[:len(prefix_lens)]
        ix = extend_indices(prefix_lens, extend_lens, rows)
        for name, want in plain(prefix_lens, extend_lens, rows).items():
            got = getattr(ix, name)
            got = got.tolist() if isinstance(got, torch.Tensor) else got
            assert got == want, f"prefix_lens {prefix_lens}, extend_lens {extend_lens}: {name} is {got}, not {want}"


@pytest.mark.parametrize("seed", range(12))
def test_ragged_attention_through_the_indices_equals_attention_per_request(seed):
    prefix_lens, extend_lens, table, slots = ragged_batch(18300 + seed)
    g = torch.Generator().manual_seed(seed)
    kv_heads, group, head_dim = 2, [1, 2, 4][seed % 3], 32
    q = torch.randn(sum(extend_lens), kv_heads * group, head_dim, generator=g).to(DEVICE)
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=g).to(DEVICE)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=g).to(DEVICE)
    got = ragged_extend_attention(q, k_pool, v_pool, extend_indices(prefix_lens, extend_lens, table))
    start = 0
    for b, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
        loc = table[b, :prefix + n].long()
        want = attention(q[start:start + n], k_pool[loc], v_pool[loc], q_start=prefix)
        err = (got[start:start + n] - want).abs().max().item()
        assert err <= 1e-4, f"prefix_lens {prefix_lens}, extend_lens {extend_lens}: request {b}'s output " \
                            f"is off by {err:.3g}"
        start += n


class Calls(TorchFunctionMode):
    """Every torch function and tensor method called under it (not those they call), and the ones that
    read a tensor's values back to the host: on a GPU each of them waits for the device."""

    READS = {"tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero", "argwhere",
             "masked_select", "unique", "unique_consecutive"}

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.names.append(name)
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        if name in self.READS:
            self.reads.append(f"{name}()")
        elif name == "cpu" and tensors and tensors[0].device.type != "cpu":
            self.reads.append("cpu()")
        elif name == "repeat_interleave" and "output_size" not in kwargs and len(tensors) > 1:
            self.reads.append("repeat_interleave() without output_size (it reads the sum of the repeats)")
        elif name == "__getitem__" and self.masks(args[1:]):
            self.reads.append("indexing by a boolean mask (the result's size is read back)")
        return func(*args, **kwargs)

    @staticmethod
    def masks(index: tuple) -> bool:
        flat = [i for item in index for i in (item if isinstance(item, tuple | list) else (item,))]
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat)


def traced(prefix_lens: list[int], extend_lens: list[int], table: torch.Tensor) -> Calls:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")       # a synchronizing call raises
    try:
        with Calls() as calls:
            extend_indices(prefix_lens, extend_lens, table)
    finally:
        if DEVICE.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("default")
    return calls


def test_the_indices_take_the_same_calls_for_one_request_or_many():
    """No loop over the requests: the work is the same torch calls whatever the batch's size."""
    counts = {}
    for batch in (1, 2, 7):
        prefix_lens, extend_lens, table, _ = ragged_batch(18400 + batch, batch)
        counts[batch] = traced(prefix_lens, extend_lens, table).names
    sizes = ", ".join(str(len(names)) for names in counts.values())
    assert counts[1] == counts[2] == counts[7], f"torch calls for 1, 2 and 7 requests: {sizes}: a loop over requests"


def test_the_indices_read_nothing_back_from_the_device():
    """The host has the lengths already: the sizes and the pointers come from its lists, and the slots are
    gathered from the page table on the device, never read back to the host."""
    prefix_lens, extend_lens, table, _ = ragged_batch(18500)
    reads = traced(prefix_lens, extend_lens, table).reads
    assert reads == [], f"the indices read values back from the device: {', '.join(reads)}"
