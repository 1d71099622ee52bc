"""Chapter 02: the paged KV cache gives chapter 01's tokens, and its allocator guards its pages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import CODE_PROMPTS, random_checkpoint, run_example
from minioverlap import LLM, SamplingParams
from minioverlap.cache.allocator import OutOfPages, PageAllocator
from minioverlap.cache.req_to_token import ReqToTokenPool
from minioverlap.cache.kv_pool import KVPool
from minioverlap.engine.attention import PagedAttention, decode_attention
from minioverlap.reference.contiguous import greedy_generate
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.reference.paged_greedy import paged_greedy_generate
from minioverlap.engine.request import Req
from minioverlap.model.qwen3 import attention


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_tokens_equal_contiguous(page_size):
    """With pages of 1, 4 or 16 slots the engine gives exactly chapter 01's greedy tokens."""
    llm = LLM(model="tiny", page_size=page_size)
    for out in llm.generate(CODE_PROMPTS[:3], SamplingParams(max_tokens=24)):
        ref = greedy_generate(llm.model, out.prompt_token_ids, 24, llm.config.eos_token_ids)
        assert out.token_ids == ref


@pytest.mark.parametrize("page_size", [1, 3])
def test_paged_tokens_equal_contiguous_on_a_gqa_checkpoint(tmp_path, page_size):
    """The same on a random 4:1 GQA checkpoint, with pages of one token and of three (which do not
    divide the 10-token prompt evenly)."""
    llm = LLM(model=str(random_checkpoint(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
              page_size=page_size)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    runner = ModelRunner(llm.model, num_pages=40, page_size=page_size, max_running=1, max_seq_len=64)
    assert paged_greedy_generate(runner, prompt, 12) == greedy_generate(llm.model, prompt, 12)


def test_req_to_token_points_into_the_requests_pages():
    """After a prefill of 10 tokens with pages of 4, the row lists the KV slots of its 3 pages, in order."""
    llm = LLM(model="tiny", page_size=4)
    runner = ModelRunner(llm.model, num_pages=10, page_size=4, max_running=2, max_seq_len=64)
    req = Req(0, list(range(100, 110)), SamplingParams(), 4)
    req.row = runner.tables.alloc()
    batch = runner.batch(ForwardMode.EXTEND, [req])
    assert len(req.pages) == 3 and 0 not in req.pages
    slots = [p * 4 + i for p in req.pages for i in range(4)][:10]
    assert runner.tables.req_to_token[req.row, :10].tolist() == slots
    assert batch.out_cache_loc.tolist() == slots and batch.positions.tolist() == list(range(10))


def test_page_zero_and_row_zero_are_never_handed_out():
    """Page 0 (so KV slot 0) and request slot 0 belong to no request, even when all are taken."""
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert sorted(alloc.alloc(7)) == list(range(1, 8))
    tables = ReqToTokenPool(max_running=3, max_seq_len=8, device="cpu")
    assert sorted(tables.alloc() for _ in range(3)) == [1, 2, 3]


def test_exhausted_allocator_raises_a_clear_error():
    """Asking for more pages than are free raises OutOfPages saying how many were asked and are free."""
    alloc = PageAllocator(num_pages=4, page_size=16)
    alloc.alloc(2)
    with pytest.raises(OutOfPages, match="asked for 2 pages, 1 of 3 are free"):
        alloc.alloc(2)
    assert alloc.num_free == 1, "a refused allocation takes nothing"


def test_double_free_is_caught():
    """Freeing a page or a request slot twice raises instead of handing it to two owners later."""
    alloc = PageAllocator(num_pages=4, page_size=16)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match=f"double free: page {pages[0]} is already free"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="page 0 is not a page of this pool"):
        alloc.free([0])
    tables = ReqToTokenPool(max_running=2, max_seq_len=8, device="cpu")
    row = tables.alloc()
    tables.free(row)
    with pytest.raises(ValueError, match=f"double free: request slot {row} is already free"):
        tables.free(row)


def test_decode_attention_equals_attention_per_request():
    """Batched decode through req_to_token equals chapter 01's attention run request by request."""
    torch.manual_seed(0)
    Hq, Hkv, D, slots = 4, 2, 8, 64
    k_pool, v_pool = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    seq_lens = [5, 1, 9]
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    perm = torch.randperm(slots - 1)[:sum(seq_lens)] + 1                # scattered KV slots, never slot 0
    start = 0
    for row, n in enumerate(seq_lens, start=1):
        req_to_token[row, :n] = perm[start:start + n]
        start += n
    q = torch.randn(3, Hq, D)
    out = decode_attention(q, k_pool, v_pool, req_to_token[1:4, :max(seq_lens)], torch.tensor(seq_lens))
    for i, n in enumerate(seq_lens):
        loc = req_to_token[i + 1, :n].long()
        ref = attention(q[i:i + 1], k_pool[loc], v_pool[loc], q_start=n - 1)
        torch.testing.assert_close(out[i:i + 1], ref)


def test_extend_attention_after_a_cached_prefix_equals_full_attention():
    """A prefill that extends a cached prefix (prefix_len > 0) gives its new tokens the outputs of causal
    attention over the whole sequence, prefix K/V read from the pool through req_to_token; requests with
    prefixes 5, 0 and 9 and scattered KV slots in one ragged batch."""
    torch.manual_seed(0)
    Hq, Hkv, D = 4, 2, 8
    pool = KVPool(num_layers=1, num_slots=64, kv_heads=Hkv, head_dim=D, dtype=torch.float32, device="cpu")
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    free = (torch.randperm(63) + 1).tolist()                             # scattered KV slots, never slot 0
    prefix_lens, extend_lens, rows = [5, 0, 9], [3, 4, 2], [1, 2, 3]
    new, refs = [], []
    for row, prefix, n in zip(rows, prefix_lens, extend_lens):
        S = prefix + n
        q, k, v = torch.randn(S, Hq, D), torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
        slots = torch.tensor([free.pop() for _ in range(S)])
        req_to_token[row, :S] = slots
        pool.store(0, slots[:prefix], k[:prefix], v[:prefix])               # the prefix: cached by an earlier step
        new.append((q[prefix:], k[prefix:], v[prefix:], slots[prefix:]))
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(Hq // Hkv, 1).transpose(0, 1),
                                             v.repeat_interleave(Hq // Hkv, 1).transpose(0, 1), is_causal=True)
        refs.append(ref.transpose(0, 1)[prefix:])                           # the new tokens' rows
    q, k, v, loc = (torch.cat(t) for t in zip(*new))
    batch = SimpleNamespace(mode=ForwardMode.EXTEND, rows=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
                            out_cache_loc=loc)
    out = PagedAttention(pool, req_to_token[rows], batch).attend(0, q, k, v)   # the page table: the batch's rows
    torch.testing.assert_close(out, torch.cat(refs))
    assert torch.equal(pool.k[0][loc], k) and torch.equal(pool.v[0][loc], v), "the new K/V are in the pool"


@pytest.mark.process
def test_the_example_shows_equal_tokens_and_the_pages_of_one_request():
    """`python examples/ch02_paged_cache.py` finds chapter 01's tokens with pages of 1, 4 and 16 slots,
    then draws a 9-token prompt in pages of 4: pages 1, 2 and 3, position 8 in KV slot 12, 4 pages free."""
    import re
    out = run_example("examples/ch02_paged_cache.py")
    for size in (" 1", " 4", "16"):
        assert f"page_size {size}: 32 tokens, equal to chapter 01's contiguous cache: True" in out
    assert re.search(r"│ 0 +│ 'def' +│ 1 +│ 4 +│", out) and re.search(r"│ 8 +│ '\):' +│ 3 +│ 12 +│", out)
    assert "free pages left: 4 of 7 (page 0 is never handed out)" in out
