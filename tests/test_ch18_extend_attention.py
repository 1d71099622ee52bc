"""Chapter 18 (so far): one attention call for the whole ragged prefill. The batched reference equals the
loop over requests it replaces, on ragged batches with and without cached prefixes and the GQA shapes of
the tiny model; the extend kernel and the GPU's FlashAttention-shaped one equal the reference (in
Triton's interpreter without a GPU); a prefill step's attention is the same work, the same number of calls and launches, for one request or
many; a CPU's decode rows go in runs of similar length, the cheapest cut, with the padded call's output;
and the fast path's prefills over cached prefixes give the reference's tokens. The engine's tokens,
unchanged, are chapters 03, 15 and 17's tests."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE
from test_ch15_kernels import close       # fp32: another order of the same sums; bf16: 2 roundings
from minioverlap import LLM, SamplingParams
from minioverlap.engine import triton_attention
from minioverlap.engine import attention as attention_module
from minioverlap.engine.attention import (PagedAttention, decode_attention, extend_indices, grouped_decode_attention,
                                         length_groups, ragged_extend_attention)
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.kernels.extend_attention import extend_attention
from minioverlap.kernels.flash_extend import flash_extend_attention
from minioverlap.model.qwen3 import attention




def ragged_case(prefix_lens: list[int], extend_lens: list[int], kv_heads: int, group: int, head_dim: int,
                page_size: int, dtype: torch.dtype, seed: int = 0):
    """Requests with prefix_lens[b] cached tokens and extend_lens[b] new ones, their slots scattered over
    a pool in pages of page_size; the page table's slots past each request's end are stale (live slots of
    others). -> q [T, Hq, D], the new k, v [T, Hkv, D] (already stored in the pool), the pools, the table."""
    g = torch.Generator().manual_seed(seed)
    ends = [p + n for p, n in zip(prefix_lens, extend_lens)]
    pages = len(ends) * -(-max(ends) // page_size)
    slots = pages * page_size
    table = torch.randint(0, slots, (len(ends), max(ends) + 3), generator=g)
    order = torch.randperm(pages, generator=g).view(len(ends), -1)          # each request its own pages
    for b, end in enumerate(ends):
        pos = torch.arange(end)
        table[b, :end] = order[b][pos // page_size] * page_size + pos % page_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)

    q = randn(sum(extend_lens), kv_heads * group, head_dim)
    k_pool, v_pool = randn(slots, kv_heads, head_dim), randn(slots, kv_heads, head_dim)
    new = torch.cat([table[b, p:e] for b, (p, e) in enumerate(zip(prefix_lens, ends))]).to(DEVICE)
    return q, k_pool[new].clone(), v_pool[new].clone(), k_pool, v_pool, table.to(DEVICE)


def per_request(q, k_pool, v_pool, table, prefix_lens, extend_lens) -> torch.Tensor:
    """The loop over requests that chapter 18 replaces (chapter 02's extend_attention)."""
    out, start = [], 0
    for row, prefix, n in zip(table, prefix_lens, extend_lens):
        loc = row[:prefix + n]
        out.append(attention(q[start:start + n], k_pool[loc], v_pool[loc], q_start=prefix))
        start += n
    return torch.cat(out)


CASES = {
    "no prefix": ([0, 0, 0], [7, 1, 23]),
    "prefixes": ([5, 0, 17, 40], [3, 9, 1, 30]),
    "one request": ([12], [20]),
    "prefix longer than a page of new": ([63, 1, 2], [2, 40, 1]),
}


# ---- the batched reference


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_batched_reference_equals_the_loop_over_requests(case, group, page_size):
    """Tiny's shape is 2 KV heads of 64, group 2; groups 1 and 4 too."""
    prefix_lens, extend_lens = CASES[case]
    q, _, _, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, group, 64, page_size, torch.float32)
    got = ragged_extend_attention(q, k_pool, v_pool, extend_indices(prefix_lens, extend_lens, table))
    close(got, per_request(q, k_pool, v_pool, table, prefix_lens, extend_lens))


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_reference_equals_the_loop_on_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 7, (1,), generator=g))
    prefix_lens = [int(x) * int(seed % 2) for x in torch.randint(0, 50, (B,), generator=g)]
    extend_lens = [int(x) for x in torch.randint(1, 40, (B,), generator=g)]
    q, _, _, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, 2, 64, 4, torch.float32, seed)
    got = ragged_extend_attention(q, k_pool, v_pool, extend_indices(prefix_lens, extend_lens, table))
    close(got, per_request(q, k_pool, v_pool, table, prefix_lens, extend_lens))


def test_the_ragged_indices_lay_out_each_request_s_slots_in_order():
    """qo_indptr over the new tokens, kv_indptr over prefix + new, kv_indices each request's row in order."""
    table = torch.arange(30).view(3, 10)
    ix = extend_indices([2, 0, 4], [3, 1, 2], table)
    assert ix.qo_indptr.tolist() == [0, 3, 4, 6] and ix.kv_indptr.tolist() == [0, 5, 6, 12]
    assert ix.kv_indices.tolist() == [0, 1, 2, 3, 4, 10, 20, 21, 22, 23, 24, 25]
    assert (ix.max_extend, ix.max_kv) == (3, 6)


# ---- the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 2])
def test_the_extend_kernel_equals_the_reference(dtype, case, group):
    """Blocks of 16 rows and 16 keys: requests across several blocks of each, and shorter than one."""
    prefix_lens, extend_lens = CASES[case]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, group, 32, 4, dtype)
    ix = extend_indices(prefix_lens, extend_lens, table)
    want = ragged_extend_attention(q, k_pool, v_pool, ix)
    got = extend_attention(q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.max_extend,
                           block_m=16, block_n=16)
    close(got, want)


@pytest.mark.parametrize("head_dim,group", [(8, 4), (48, 1), (64, 2)])
def test_the_extend_kernel_pads_a_head_dim_that_is_no_power_of_two(head_dim, group):
    prefix_lens, extend_lens = [9, 0], [5, 20]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, group, head_dim, 4, torch.float32)
    ix = extend_indices(prefix_lens, extend_lens, table)
    got = extend_attention(q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.max_extend)
    close(got, ragged_extend_attention(q, k_pool, v_pool, ix))


# ---- the GPU's kernel: FlashAttention-2's tiles, the same function


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("config", [(32, 16, 4, 2), None], ids=["blocks of 32x16", "the default"])
def test_the_flash_kernel_equals_the_reference(dtype, case, group, config):
    """Blocks of 32 rows and 16 keys (several of each a request, a diagonal of two key blocks, a prefix's
    partial last block) and the default: bf16 at head_dim 64 128 x 64 (one block, all masked), fp32 16 x 16."""
    prefix_lens, extend_lens = CASES[case]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, group, 64, 4, dtype)
    ix = extend_indices(prefix_lens, extend_lens, table)
    got = flash_extend_attention(q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices,
                                 ix.max_extend, config=config)
    close(got, ragged_extend_attention(q, k_pool, v_pool, ix))


@pytest.mark.parametrize("seed", range(4))
def test_the_flash_kernel_equals_the_reference_on_random_ragged_batches(seed):
    """The 8B's head_dim (128) and GQA group (4), bf16, in its own blocks of 128 x 64: up to 5 requests of
    1 to 300 new tokens (decode rows among them), half the batches after cached prefixes of up to 200."""
    g = torch.Generator().manual_seed(200 + seed)
    B = int(torch.randint(1, 6, (1,), generator=g))
    prefix_lens = [int(x) * (seed % 2) for x in torch.randint(0, 200, (B,), generator=g)]
    extend_lens = [int(x) for x in torch.randint(1, 300, (B,), generator=g)]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 1, 4, 128, 16, torch.bfloat16, seed)
    ix = extend_indices(prefix_lens, extend_lens, table)
    got = flash_extend_attention(q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.max_extend)
    close(got, ragged_extend_attention(q, k_pool, v_pool, ix))


@pytest.mark.parametrize("head_dim,group", [(8, 4), (48, 1), (80, 2)])
def test_the_flash_kernel_pads_a_head_dim_that_is_no_power_of_two(head_dim, group):
    prefix_lens, extend_lens = [9, 0, 70], [5, 40, 33]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, group, head_dim, 4, torch.float32)
    ix = extend_indices(prefix_lens, extend_lens, table)
    got = flash_extend_attention(q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices,
                                 ix.max_extend, config=(32, 16, 4, 2))
    close(got, ragged_extend_attention(q, k_pool, v_pool, ix))


def test_the_flash_kernel_reads_new_k_and_v_through_their_strides():
    """As the fast path passes them: v a slice of the merged q/k/v projection, k a copy of its own."""
    prefix_lens, extend_lens = [20, 3], [45, 17]
    q, k, v, k_pool, v_pool, table = ragged_case(prefix_lens, extend_lens, 2, 2, 64, 4, torch.float32)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    v_view = qkv[:, q[0].numel() + k[0].numel():].view(v.shape)
    assert not v_view.is_contiguous()
    ix = extend_indices(prefix_lens, extend_lens, table)
    got = flash_extend_attention(q, k, v_view, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices,
                                 ix.max_extend, config=(32, 16, 4, 2))
    close(got, ragged_extend_attention(q, k_pool, v_pool, ix))


# ---- the launches of a prefill step


class CountOps(TorchDispatchMode):
    """Every aten operator called under it: on a GPU, each one a kernel launch (or none: a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def prefill_counts(monkeypatch, kernels: bool, prompts: list[list[int]]) -> tuple[int, int, int]:
    """One prefill step of these prompts -> (its requests, the aten operators its attention called over
    every layer, the extend kernel's launches)."""
    llm = LLM(model="tiny", kernels=kernels, overlap=False, page_size=4, chunked_prefill_size=-1)
    steps, launches = [], []      # counted from here: on a GPU the engine's start runs a step of its own
    forward = ModelRunner.forward

    def counted_forward(self, batch, input_ids, ctx):
        if batch.mode is not ForwardMode.EXTEND:
            return forward(self, batch, input_ids, ctx)
        attend = ctx.attend
        counter = CountOps()

        def counted_attend(*args):
            with counter:
                return attend(*args)
        ctx.attend = counted_attend
        out = forward(self, batch, input_ids, ctx)
        steps.append((len(batch.reqs), counter.ops))
        return out

    def counted(kernel):
        def counted_kernel(*args, **kwargs):
            launches.append(1)
            return kernel(*args, **kwargs)
        return counted_kernel
    monkeypatch.setattr(ModelRunner, "forward", counted_forward)
    monkeypatch.setattr(triton_attention, "extend_attention", counted(extend_attention))       # the interpreter's
    monkeypatch.setattr(triton_attention, "flash_extend_attention", counted(flash_extend_attention))   # a GPU's
    llm.generate(prompts, SamplingParams(max_tokens=1))
    assert len(steps) == 1, f"the prompts should be one prefill step, not {len(steps)}"
    return steps[0][0], steps[0][1], len(launches)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True])
def test_a_prefill_step_s_attention_launches_do_not_depend_on_its_requests(monkeypatch, kernels):
    """One prompt or five, one long and four short: the same operators in every layer's attention (the
    loop over requests called a dozen per request), and on the fast path one extend kernel a layer."""
    one = prefill_counts(monkeypatch, kernels, [list(range(10, 50))])
    five = prefill_counts(monkeypatch, kernels, [list(range(10, 50)), [3, 4], [5] * 9, list(range(60, 77)), [8, 9]])
    layers = 6                                                          # the tiny model's
    assert (one[0], five[0]) == (1, 5)
    assert one[1] == five[1], f"attention ops: {one[1]} for one request, {five[1]} for five"
    assert one[2] == five[2] == (layers if kernels else 0)


def mixed_step_ops(monkeypatch, streams: int) -> list[tuple[int, int]]:
    """`streams` requests decode; a 30-token prompt arrives and runs in chunks of 8 mixed with their decode
    rows -> (requests, attention operators over every layer) of each step that has both kinds of rows."""
    seen = []
    forward = ModelRunner.forward

    def counted_forward(self, batch, input_ids, ctx):
        attend, counter = ctx.attend, CountOps()

        def counted_attend(*args):
            with counter:
                return attend(*args)
        ctx.attend = counted_attend
        out = forward(self, batch, input_ids, ctx)
        if batch.mode is ForwardMode.EXTEND and 1 in batch.extend_lens and max(batch.extend_lens) > 1:
            seen.append((len(batch.reqs), counter.ops))
        return out
    monkeypatch.setattr(ModelRunner, "forward", counted_forward)
    llm = LLM(model="tiny", kernels=False, overlap=False, chunked_prefill_size=8 + streams, mixed_chunk=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for reply in llm.stream([[5 + i, 6] for i in range(streams)], params):
        if reply.uid == 0 and len(llm.scheduler.running) == streams and llm.next_uid == streams:
            llm.add_request(list(range(200, 230)), params)
    monkeypatch.undo()
    return seen


def test_a_mixed_step_s_attention_is_two_calls_however_many_decode_rows(monkeypatch):
    """A mixed step's prompt rows in one ragged call and its one-token decode rows in one decode call: the
    same operators with 2 decode rows as with 6 (each padded into the ragged call would cost a chunk's)."""
    two, six = mixed_step_ops(monkeypatch, 2), mixed_step_ops(monkeypatch, 6)
    assert two and six, "no step mixed a chunk with decode rows"
    assert {reqs for reqs, _ in two} == {3} and {reqs for reqs, _ in six} == {7}
    assert {ops for _, ops in two} == {ops for _, ops in six}, (two, six)


# ---- decode rows of similar length together (on a CPU)


def padded_cost(runs: list[list[int]], lens: list[int]) -> int:
    """What a split of the rows costs: each run's rows x its longest, plus CALL_SLOTS a run."""
    return sum(len(run) * max(max(lens[i] for i in run), 1) + attention_module.CALL_SLOTS for run in runs)


def splits(order: list[int]):
    """Every cut of the rows, in order, into consecutive runs."""
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        runs, run = [], [order[0]]
        for row, cut in zip(order[1:], cuts):
            runs, run = (runs + [run], [row]) if cut else (runs, run + [row])
        yield runs + [run]


def test_decode_rows_are_cut_into_runs_of_similar_length():
    """A long request among streams gets a call of its own; rows of one length share one; and the cut is
    the cheapest of all cuts of the sorted rows into runs (each run padded to its longest, a call's cost)."""
    streams = [300 + 7 * i for i in range(12)]
    assert length_groups(tuple(streams + [808])) == [(list(range(12)), 377), ([12], 808)]
    assert length_groups(tuple(streams)) == [(list(range(12)), 377)]
    assert length_groups(tuple([900, 5, 310, 6, 300, 7, 320])) == [([1, 3, 5], 7), ([4, 2, 6], 320), ([0], 900)]
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        lens = torch.randint(1, 1200, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        order = sorted(range(len(lens)), key=lens.__getitem__)
        runs = [rows for rows, _ in length_groups(tuple(lens))]
        assert sorted(i for run in runs for i in run) == list(range(len(lens)))
        assert padded_cost(runs, lens) == min(padded_cost(split, lens) for split in splits(order)), lens


def test_grouped_decode_attention_equals_one_padded_call_and_pads_less(monkeypatch):
    """Twelve streams and a long request: the grouped attention's output is the padded call's, from two
    calls that read 12 x 377 + 808 slots instead of 13 x 808."""
    g = torch.Generator().manual_seed(1)
    lens = [300 + 7 * i for i in range(12)] + [808]
    k_pool, v_pool = torch.randn(16 * 1000, 2, 64, generator=g), torch.randn(16 * 1000, 2, 64, generator=g)
    table = torch.randint(1, 16 * 1000, (len(lens), max(lens)), generator=g)
    q, seq_lens = torch.randn(len(lens), 4, 64, generator=g), torch.tensor(lens)
    want = decode_attention(q, k_pool, v_pool, table, seq_lens)
    widths = []

    def counted(q, k_pool, v_pool, page_table, seq_lens):
        widths.append(tuple(page_table.shape))
        return decode_attention(q, k_pool, v_pool, page_table, seq_lens)
    monkeypatch.setattr(attention_module, "decode_attention", counted)
    close(grouped_decode_attention(q, k_pool, v_pool, table, seq_lens), want)
    assert widths == [(12, 377), (1, 808)]


# ---- the engine


SYSTEM = list(range(100, 130))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_the_fast_path_s_prefills_with_cached_prefixes_give_the_reference_tokens(overlap):
    """Prompts that share a system prompt, sent twice: the second time every prefill is a ragged batch of
    cached prefixes (the kernel's prefix loop) and new tokens of several lengths (its causal part)."""
    prompts = [SYSTEM + [7, 8, 9], SYSTEM[:13] + [3] * 20, SYSTEM + list(range(40, 58)), [5, 6]]
    params = SamplingParams(max_tokens=2, ignore_eos=True)        # the prefill, then one step that reads it

    def rounds(kernels: bool) -> list[list[list[int]]]:
        llm = LLM(model="tiny", kernels=kernels, overlap=overlap, page_size=4)
        runs = [llm.generate(prompts, params) for _ in range(2)]
        assert sum(o.cached_tokens for o in runs[1]) > 0, "the second round should hit the cache"
        llm.check_integrity()
        return [[o.token_ids for o in run] for run in runs]
    assert rounds(kernels=True) == rounds(kernels=False)
