"""Chapter 15: every kernel of the fast path equals the PyTorch code it replaces, on ragged batches,
pages of 1 and 16 tokens, GQA ratios 1/2/4 and verify windows of 1..k+1 rows; then the engine's greedy
tokens on the fast path equal the reference path's, in both loops, with MTP on and off.

Without a GPU the kernels run in Triton's interpreter (minioverlap/kernels/__init__.py); with
MINIOVERLAP_TEST_DEVICE=cuda they run compiled on the GPU. Tolerances: fp32, 2e-5 (the same arithmetic
in another order); bf16, 2 roundings of the largest value (the kernels round once where the reference
rounds after every operation)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, random_checkpoint, sampled
from minioverlap import LLM, SamplingParams
from minioverlap.cache import req_to_token
from minioverlap.device import transfer
from minioverlap.device.hazard import HazardError
from minioverlap.engine.attention import PagedAttention, window_attention
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.kernels.attention import paged_attention
from minioverlap.kernels.elementwise import add_rms_norm, qk_norm_rope, silu_mul
from minioverlap.kernels.kv_store import store_kv
from minioverlap.engine.triton_attention import TritonAttention
from minioverlap.model.fused import FusedMTPLayer, FusedQwen3ForCausalLM, merge_projections
from minioverlap.model.qwen3 import Attention, MLP, Qwen3Config, RMSNorm, apply_rope, rope_cos_sin
from test_ch08_fence import slot_handover

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to the reference within the stated tolerance of its dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(1.0, want.abs().max().item())
    atol = 2e-5 * scale if want.dtype == torch.float32 else 2 * 2 ** -7 * scale
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"max error {err:.3g} > {atol:.3g}"


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


# ---- the KV store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (2, 64), (4, 32)])
def test_the_kv_store_writes_each_token_at_its_slot_and_nothing_else(dtype, kv_heads, head_dim):
    slots, T = 40, 7
    loc = torch.tensor([3, 39, 0, 17, 16, 8, 25], device=DEVICE)
    qkv = randn(T, 5 * kv_heads * head_dim, dtype=dtype)                 # k and v as views of a wider row
    k = qkv[:, :kv_heads * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, 3 * kv_heads * head_dim:4 * kv_heads * head_dim].view(T, kv_heads, head_dim)
    k_pool, v_pool = randn(slots, kv_heads, head_dim, dtype=dtype, seed=1), randn(slots, kv_heads, head_dim, dtype=dtype, seed=2)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref[loc], v_ref[loc] = k, v
    store_kv(k_pool, v_pool, loc, k, v)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)     # a copy: bit for bit


@pytest.mark.parametrize("kv_heads,head_dim", [(3, 16), (2, 48)])
def test_the_kv_store_masks_a_row_that_is_no_power_of_two_wide(kv_heads, head_dim):
    """kv_heads x head_dim = 48 or 96: the kernel's lanes, a power of two, reach past the row. The lanes
    past it must neither store (into the next slot, which the test checks is untouched) nor load."""
    slots, T = 40, 3
    loc = torch.tensor([5, 20, 11], device=DEVICE)                     # each slot's next one is not written
    qkv = randn(T, 5 * kv_heads * head_dim, dtype=torch.float32)
    k = qkv[:, :kv_heads * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, 3 * kv_heads * head_dim:4 * kv_heads * head_dim].view(T, kv_heads, head_dim)
    k_pool, v_pool = (randn(slots, kv_heads, head_dim, dtype=torch.float32, seed=s) for s in (1, 2))
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref[loc], v_ref[loc] = k, v
    store_kv(k_pool, v_pool, loc, k, v)
    untouched = torch.equal(k_pool[loc + 1], k_ref[loc + 1]) and torch.equal(v_pool[loc + 1], v_ref[loc + 1])
    assert untouched, "the slot after a stored token's changed: the lanes past kv_heads x head_dim stored"
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


def test_the_kv_store_reads_its_slots_from_a_strided_view():
    """loc as a column of a wider tensor (MTP's draft rows take window row j of every request this way):
    each token's own slot, not the next element in memory."""
    kv_heads, head_dim, T = 2, 16, 5
    window = torch.tensor([[3, 4, 5], [20, 21, 22], [9, 10, 11], [30, 31, 32], [0, 1, 2]], device=DEVICE)
    k, v = (randn(T, kv_heads, head_dim, dtype=torch.float32, seed=s) for s in (1, 2))
    k_pool, v_pool = (randn(40, kv_heads, head_dim, dtype=torch.float32, seed=s) for s in (3, 4))
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref[window[:, 1]], v_ref[window[:, 1]] = k, v
    store_kv(k_pool, v_pool, window[:, 1], k, v)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


# ---- paged attention, split over the context


def paged_case(lens: list[int], window: int, kv_heads: int, group: int, head_dim: int, page_size: int,
               dtype: torch.dtype, seed: int = 0):
    """Requests whose windows end at lens[b] + window - 1, their slots scattered over a pool in pages of
    page_size, the page table's slots past each request's end stale (pointing at live slots of others)."""
    g = torch.Generator().manual_seed(seed)
    pages = 2 * -(-(max(lens) + window) // page_size)              # half of them used by each request
    slots = pages * page_size
    width = max(lens) + window + 5
    table = torch.randint(0, slots, (len(lens), width), generator=g, dtype=torch.int32)
    for b, n in enumerate(lens):
        order, pos = torch.randperm(pages, generator=g), torch.arange(n + window)
        table[b, :n + window] = (order[pos // page_size] * page_size + pos % page_size).int()
    positions = torch.cat([torch.arange(n, n + window) for n in lens])
    q = randn(len(lens) * window, kv_heads * group, head_dim, dtype=dtype, seed=seed + 1)
    k_pool = randn(slots, kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    v_pool = randn(slots, kv_heads, head_dim, dtype=dtype, seed=seed + 3)
    return q, k_pool, v_pool, table.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("dtype", sampled(DTYPES, DTYPES[:1]))
@pytest.mark.parametrize("page_size", sampled([1, 16], [16]))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_paged_attention_equals_the_reference(dtype, page_size, group, window):
    """Ragged lengths: a first token (0), one short of a block, across blocks, across every split."""
    q, k_pool, v_pool, table, positions = paged_case([0, 31, 70, 130], window, 2, group, 32, page_size, dtype)
    want = window_attention(q, k_pool, v_pool, table, positions)
    for splits in (1, 4):
        close(paged_attention(q, k_pool, v_pool, table, None, positions, window, splits=splits), want)


@pytest.mark.parametrize("splits", [2, 8, 16])
def test_splits_past_a_short_request_weigh_nothing(splits):
    """More splits than a request has blocks: the empty ones have lse = -inf and must not count."""
    q, k_pool, v_pool, table, positions = paged_case([3, 40], 1, 2, 2, 16, 16, torch.float32)
    want = window_attention(q, k_pool, v_pool, table, positions)
    close(paged_attention(q, k_pool, v_pool, table, None, positions, 1, splits=splits), want)


@pytest.mark.parametrize("splits", [2, 4])
def test_the_merge_holds_scores_whose_exp_overflows(splits):
    """Every score near 100 (a shared component of q and k): a split's lse is past 88, where exp overflows
    fp32. The merge must weigh the splits by exp(lse - the largest lse), as the split kernel subtracts its
    running maximum, or inf / inf makes the output nan."""
    q, k_pool, v_pool, table, positions = paged_case([5, 70], 1, 2, 2, 16, 4, torch.float32)
    q[..., 0], k_pool[..., 0] = 20.0, 20.0                # 20 x 20 x 16 ** -0.5 = 100 added to every score
    want = window_attention(q, k_pool, v_pool, table, positions)
    got = paged_attention(q, k_pool, v_pool, table, None, positions, 1, splits=splits)
    finite = bool(got.isfinite().all())
    assert finite, "the output holds nan or inf: the merge's weights overflowed, exp(lse) is inf"
    close(got, want)


@pytest.mark.parametrize("head_dim,group", [(8, 4), (48, 1), (24, 2)])
def test_paged_attention_pads_a_head_dim_that_is_no_power_of_two(head_dim, group):
    """head_dim under 16 (tl.dot's least) or not a power of two: masked lanes, the same result."""
    q, k_pool, v_pool, table, positions = paged_case([5, 37], 2, 2, group, head_dim, 4, torch.float32)
    want = window_attention(q, k_pool, v_pool, table, positions)
    for splits in (1, 4):
        close(paged_attention(q, k_pool, v_pool, table, None, positions, 2, splits=splits), want)


@pytest.mark.slow
def test_a_request_s_attention_does_not_depend_on_its_batch():
    """The split count is the device's, not the batch's: each request alone gives, bit for bit, what it
    gives in a batch of 16 (its attention must not depend on which requests share its step)."""
    lens = [3, 40, 77, 130, 9, 64, 100, 31, 1, 55, 90, 120, 17, 33, 70, 5]
    q, k_pool, v_pool, table, positions = paged_case(lens, 1, 8, 4, 64, 16, torch.float32)
    batched = paged_attention(q, k_pool, v_pool, table, None, positions, 1)
    for b in (0, 3, 15):
        alone = paged_attention(q[b:b + 1], k_pool, v_pool, table[b:b + 1], None, positions[b:b + 1], 1)
        assert torch.equal(alone[0], batched[b])


def test_paged_attention_reads_positions_from_a_strided_view():
    """positions as column j of a [B, W] window (MTP's draft rows): each request's own position."""
    q, k_pool, v_pool, table, positions = paged_case([12, 50, 33], 1, 2, 2, 16, 16, torch.float32)
    window = torch.stack([positions - 1, positions, positions + 1], dim=1)      # [B, 3], row b at column 1
    want = window_attention(q, k_pool, v_pool, table, positions)
    close(paged_attention(q, k_pool, v_pool, table, None, window[:, 1], 1, splits=2), want)


def test_paged_attention_reads_the_rows_it_is_given():
    """req_to_token itself, each request at its own row (rows given), equals the step's copy of the rows."""
    q, k_pool, v_pool, table, positions = paged_case([12, 50, 33], 3, 2, 2, 16, 16, torch.float32)
    req_to_token = torch.zeros(6, table.shape[1], dtype=table.dtype, device=DEVICE)
    rows = torch.tensor([4, 1, 2], device=DEVICE)
    req_to_token[rows] = table
    want = window_attention(q, k_pool, v_pool, table, positions)
    close(paged_attention(q, k_pool, v_pool, req_to_token, rows, positions, 3, splits=2), want)


# ---- the elementwise groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_add_rms_norm_equals_the_add_then_the_norm(dtype, hidden):
    norm = RMSNorm(hidden, 1e-6).to(device=DEVICE, dtype=dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=5)
    x, residual = randn(5, hidden, dtype=dtype, seed=1), randn(5, hidden, dtype=dtype, seed=2)
    want_residual = x + residual
    out, stream = add_rms_norm(x, residual.clone(), norm.weight, norm.eps)
    close(stream, want_residual)
    close(out, norm(want_residual))
    first, stream = add_rms_norm(x, None, norm.weight, norm.eps)          # the first layer: x is the stream
    assert stream is x
    close(first, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 64), (32, 8, 128), (8, 2, 8), (2, 2, 48)])
def test_qk_norm_rope_equals_the_norms_then_the_rotation(dtype, heads, kv_heads, head_dim):
    config = Qwen3Config(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    attn = Attention(config, 0).to(device=DEVICE, dtype=dtype)
    attn.q_norm.weight.data, attn.k_norm.weight.data = randn(head_dim, dtype=dtype, seed=3), randn(head_dim, dtype=dtype, seed=4)
    T = 5
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 7, 8, 300, 1000], device=DEVICE)
    cos, sin = rope_cos_sin(positions, head_dim, 1e6)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    want_q = apply_rope(attn.q_norm(q_ref.reshape(T, heads, head_dim)), cos.to(dtype), sin.to(dtype))
    want_k = apply_rope(attn.k_norm(k_ref.reshape(T, kv_heads, head_dim)), cos.to(dtype), sin.to(dtype))
    weight = torch.stack([attn.q_norm.weight, attn.k_norm.weight])
    q, k, v = qk_norm_rope(qkv, weight, cos, sin, heads, kv_heads, attn.q_norm.eps)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(v, v_ref.reshape(T, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_mul_equals_silu_of_gate_times_up(dtype, width):
    gate_up = randn(3, 2 * width, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=1)
    close(silu_mul(gate_up), F.silu(gate) * up)


def test_merged_projections_share_the_reference_weights():
    """After the merge, q/k/v and gate/up are views of the merged weight: nothing is stored twice, and
    the merged product's slices are the separate products."""
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)
    attn, mlp = Attention(config, 0), MLP(config)
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
        merge_projections(torch.nn.ModuleList([attn, mlp]))
        qkv, gate_up = F.linear(x, attn.qkv_weight), F.linear(x, mlp.gate_up_weight)
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    for got, ref in zip([*qkv.split([64, 32, 32], dim=1), *gate_up.chunk(2, dim=1)], want):
        torch.testing.assert_close(got, ref)
    torch.testing.assert_close(attn.q_proj(x), want[0])


# ---- the engine on the fast path


PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", [5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mtp_steps", [0, 3])
def test_the_fast_path_tokens_equal_the_reference(overlap, mtp_steps):
    """Greedy tokens, and with MTP the same verify steps: drafts are the drafter's, so a drafter that read
    another request's position or stored its K and V at another's slot would show in the accept lengths.
    The third prompt is longer than a block of keys (BLOCK_N, 32), so from the first decode step on both
    splits hold keys and the merge weighs two real parts."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = dict(model="tiny", overlap=overlap, mtp_steps=mtp_steps, page_size=4)
    ref = LLM(**engine, kernels=False)
    fast = LLM(**engine, kernels=True)
    assert isinstance(fast.model, FusedQwen3ForCausalLM) and fast.runner.attention_class is TritonAttention
    assert not isinstance(ref.model, FusedQwen3ForCausalLM) and ref.runner.attention_class is PagedAttention
    assert not mtp_steps or (isinstance(fast.runner.mtp, FusedMTPLayer) and hasattr(fast.runner.mtp.self_attn, "qkv_weight"))
    prompts = [*PROMPTS[:2], list(range(5, 45))]
    got = [(o.token_ids, o.verify_steps) for o in fast.generate(prompts, params)]
    assert got == [(o.token_ids, o.verify_steps) for o in ref.generate(prompts, params)]    # the same drafts, too
    fast.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32),
                                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=96),
                                   dict(num_attention_heads=2, num_key_value_heads=2, head_dim=48)])
def test_the_fast_path_tokens_equal_the_reference_on_unseen_checkpoints(tmp_path, shape):
    """GQA ratios 1 and 4, other widths, a head_dim that is no power of two: shapes the tiny model lacks."""
    path = random_checkpoint(tmp_path / "ckpt", seed=3, **shape)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(10, 40))]
    want = [o.token_ids for o in LLM(model=str(path), kernels=False).generate(prompts, params)]
    assert [o.token_ids for o in LLM(model=str(path), kernels=True).generate(prompts, params)] == want


# ---- the fence and the checker on the fast path


class ReadsTheTableInTheForward(PagedAttention):
    """The fast path's attention reading the page table itself, in its first layer: after the step's
    read-done event, where a kernel that read req_to_token directly would read it."""

    def __init__(self, runner: ModelRunner, batch) -> None:
        super().__init__(runner.kv_pool, None, batch)
        self.tables = runner.tables

    def attend(self, layer_id, q, k, v):
        if self.page_table is None:
            self.page_table = self.tables.page_table(self.batch)
        return super().attend(layer_id, q, k, v)


@pytest.mark.slow
def test_the_checker_is_silent_on_the_fast_path_and_fires_when_its_table_read_follows_the_event(monkeypatch):
    """The fence's event must follow the last read of the shared tables. On chapter 08's slot handover, on
    the fast path as on the reference, attention reads the step's copy of the page table, made before the
    event: silence. An attention that reads the table in its first layer, one kernel after the event,
    races with B's write."""
    error, a_len, b_len = slot_handover(kernels=True)
    assert error is None and b_len > a_len
    attention = ModelRunner.attention          # a graphed step (on a GPU) replays the table its graph reads
    monkeypatch.setattr(ModelRunner, "attention", lambda self, batch: attention(self, batch)
                        if self.graphs_for(batch) else ReadsTheTableInTheForward(self, batch))
    error, _, _ = slot_handover(kernels=True, cuda_graphs=False)       # the planted attention runs eagerly
    assert isinstance(error, HazardError)
    assert re.search(r"req_to_token row 1.*read on the forward stream \(step \d+: attention reads the page table\)",
                     str(error)), error


# ---- the host's work: one copy of a step's index lists


@pytest.mark.parametrize("mtp_steps", [0, 2])
def test_a_step_s_index_tensors_are_views_of_one_copy(mtp_steps):
    """build_batch (and a verify step's build_verify_batch) sends every index list of the step in one
    copy: positions, KV slots, rows, lengths, last indices and token rows share one device buffer."""
    llm = LLM(model="tiny", mtp_steps=mtp_steps, max_running=3)
    runner, batches = llm.runner, []
    build = runner.batch

    def keep(mode, reqs):
        batches.append(build(mode, reqs))
        return batches[-1]
    runner.batch = keep
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    modes = {b.mode for b in batches}
    assert ForwardMode.EXTEND in modes and (ForwardMode.TARGET_VERIFY if mtp_steps else ForwardMode.DECODE) in modes
    for b in batches:
        fields = [b.req_pool_indices, b.last_index, b.token_rows]
        if b.mode is not ForwardMode.TARGET_VERIFY:      # a verify step's window is laid out on the device
            fields += [b.positions, b.out_cache_loc, b.seq_lens]
        assert len({t.untyped_storage().data_ptr() for t in fields}) == 1, b.mode


def test_a_plain_step_writes_its_new_kv_slots_with_no_copy_of_their_own(monkeypatch):
    """build_batch writes every request's new KV slots into req_to_token from the batch's own device
    tensors (out_cache_loc at token_rows, positions): a decode step of three requests sends one host
    list to the device, its index lists, where writing each request's slots copied three more."""
    llm = LLM(model="tiny", max_running=3)
    copies, per_batch = [], []
    real = transfer.to_device

    def counted(values, *args):
        copies.append(len(values))
        return real(values, *args)
    monkeypatch.setattr(transfer, "to_device", counted)
    monkeypatch.setattr(req_to_token, "to_device", counted)
    build = llm.runner.batch

    def batch(mode, reqs):
        before = len(copies)
        made = build(mode, reqs)
        per_batch.append((mode, len(reqs), len(copies) - before))
        return made
    llm.runner.batch = batch
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(model="tiny").generate(PROMPTS, SamplingParams(
        max_tokens=4, ignore_eos=True))]
    decode = [(n, sent) for mode, n, sent in per_batch if mode is ForwardMode.DECODE]
    assert (3, 1) in decode and all(sent == 1 for _, sent in decode), per_batch
    llm.check_integrity()


def test_bad_kernels_flags_are_refused():
    for value in (1, "yes"):
        with pytest.raises(ValueError, match=rf"kernels must be True or False, got {value!r}"):
            LLM(model="tiny", kernels=value)
