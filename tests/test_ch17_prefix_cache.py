"""Chapter 17: the prefix cache. Tokens equal the engine's without it (on a grid: both loops, page
sizes 1, 4 and 16, MTP off and on), on prompts that share prefixes of many lengths; the tree evicts in
the middle of a run; aborts of every kind leave the engine as good as new; the hazard checker stays
silent; and the account of every page holds after every run."""

from __future__ import annotations

import itertools

import pytest
import torch

from minioverlap import LLM, SamplingParams
from minioverlap.cache.allocator import PageAllocator
from minioverlap.cache.radix import RadixCache
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardError
from minioverlap.engine.forward_batch import ForwardMode
from test_ch16_logprobs_stop import LOOPS, engines  # noqa: F401  (engines: the module's engine per setting)
from conftest import CODE_PROMPTS, sampled
from test_ch16_sampling_fields import hf_generate

SYSTEM = list(range(100, 150))                       # a 50-token "system prompt"
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def shared_prompts() -> list[list[int]]:
    """Prompts sharing prefixes of many lengths: a whole prompt twice, one that is a prefix of another,
    prefixes ending inside a page for every page size, and one that shares nothing."""
    return [SYSTEM + [7, 8, 9], SYSTEM + [11, 12], SYSTEM[:33], SYSTEM + [7, 8, 9], SYSTEM[:17] + [3] * 14,
            list(range(300, 340))]


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, int], list[list[int]]]:
    """The engine without the cache, normal loop: each page size's and MTP setting's tokens, once."""
    return {}


def baseline(cache: dict, prompts: list[list[int]], page_size: int, mtp: int) -> list[list[int]]:
    key = (tuple(map(tuple, prompts)), page_size, mtp)
    if key not in cache:
        llm = LLM(page_size=page_size, overlap=False, mtp_steps=mtp, prefix_cache=False)
        cache[key] = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    return cache[key]


@pytest.mark.parametrize("page_size,mtp", sampled(list(itertools.product((1, 4, 16), (0, 3))), [(4, 0), (16, 3)]))
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_tokens_equal_the_engine_without_the_cache(expected, overlap, page_size, mtp):
    """On the grid (both loops, each page size, MTP off and on): a first run (the prompts prefill
    together, each computes its own copy), a second run (every prompt hits), then a prompt that extends
    a finished request's output: equal tokens, no hazard, the account holds after each."""
    llm = LLM(page_size=page_size, overlap=overlap, mtp_steps=mtp, hazard_check=True)
    prompts = shared_prompts()
    want = baseline(expected, prompts, page_size, mtp)
    for run in range(2):
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == want, f"run {run + 1}"
        llm.check_integrity()
    whole = [(len(p) - 1) // page_size * page_size for p in prompts]   # every prompt was seen, with its output
    assert [o.cached_tokens for o in outs] == whole
    longer = [prompts[0] + outs[0].token_ids + [5, 6]]          # a second turn: the first one's history, and more
    [turn] = llm.generate(longer, PARAMS)
    assert turn.token_ids == baseline(expected, longer, page_size, mtp)[0]
    history = len(prompts[0]) + len(outs[0].token_ids) - 1          # the finished request's tokens with K and V
    assert turn.cached_tokens == history // page_size * page_size, "its output was cached too"
    llm.check_integrity()


def test_prompt_tokens_served_from_the_cache_are_whole_pages_and_never_the_last():
    """A prompt seen before is served from the cache up to its last whole page before its last token:
    the prefill always computes at least that token, whose logits give the first new token."""
    for page_size, length in [(1, 10), (4, 12), (4, 13), (16, 40), (16, 48)]:
        llm = LLM(page_size=page_size)
        prompt = list(range(200, 200 + length))
        first, second = (llm.generate([prompt], PARAMS)[0] for _ in range(2))
        assert first.cached_tokens == 0
        assert second.cached_tokens == (length - 1) // page_size * page_size, (page_size, length)
        assert second.token_ids == first.token_ids


def test_a_hit_shortens_the_prefill_and_the_trace_shows_it():
    llm = LLM(page_size=4)
    computed = []
    batch = llm.runner.batch
    llm.runner.batch = lambda mode, reqs: (computed.extend(len(r.prompt_ids) - r.seq_len for r in reqs)
                                           if mode is ForwardMode.EXTEND else None) or batch(mode, reqs)
    llm.generate([SYSTEM + [1, 2, 3]], PARAMS)
    assert not any(e.kind == "hit" for e in llm.trace)
    [out] = llm.generate([SYSTEM + [4, 5]], PARAMS)
    assert computed == [53, 52 - 48] and out.cached_tokens == 48
    assert [(e.kind, e.uids) for e in llm.trace[:2]] == [("hit", (1,)), ("schedule", (1,))]


def test_with_the_cache_off_every_prompt_is_prefilled_from_scratch():
    llm = LLM(prefix_cache=False)
    outs = [llm.generate([SYSTEM], PARAMS)[0] for _ in range(2)]
    assert llm.runner.cache.tree is None and [o.cached_tokens for o in outs] == [0, 0]
    assert llm.runner.allocator.num_free == llm.runner.usable_pages
    with pytest.raises(ValueError, match="prefix_cache must be True or False, got 1"):
        LLM(prefix_cache=1)


def test_a_prompt_seen_before_drafts_as_it_did():
    """With MTP the drafter's K and V of a cached prefix come from the same slots, keyed by each token and
    the next one: a prompt seen before drafts exactly as it did, in the same target passes."""
    for page_size in (1, 4, 16):
        llm = LLM(page_size=page_size, mtp_steps=3)
        prompt = SYSTEM + [7, 8, 9]
        first, second = (llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0] for _ in range(2))
        assert second.cached_tokens == (len(prompt) - 1) // page_size * page_size
        assert second.token_ids == first.token_ids
        assert second.verify_steps == first.verify_steps, page_size


def drafter_keys(llm: LLM, prompt: list[int], positions: int) -> tuple[torch.Tensor, int]:
    """Run one prompt; as its request is freed, the drafter's K at its first `positions` positions, and
    how many prompt tokens it found in the cache."""
    release, seen = llm.runner.release, {}

    def keep_then_release(req):
        slots = llm.runner.allocator.kv_slots(req.pages, 0, positions)
        seen["k"], seen["cached"] = llm.runner.draft_kv_pool.k[0][slots].clone(), req.cached_tokens
        release(req)

    llm.runner.release = keep_then_release
    llm.generate([prompt], PARAMS)
    llm.runner.release = release
    return seen["k"], seen["cached"]


def test_the_drafter_k_and_v_of_a_match_are_those_of_its_own_tokens():
    """Two prompts that part exactly at a page boundary (position 24, pages of 4). The drafter's K at
    position 23 was computed from the token at 24, which differs: the bigram key does not match that page
    (20 tokens from the cache), and when the second prompt is cached its own copy of the page is no
    duplicate. Its drafter's K at every position equals a fresh engine's."""
    first, second = SYSTEM[:24] + [7] * 6, SYSTEM[:24] + [9] * 6
    llm = LLM(page_size=4, mtp_steps=3)
    llm.generate([first], PARAMS)
    cached_k, cached = drafter_keys(llm, second, 24)
    fresh_k, _ = drafter_keys(LLM(page_size=4, mtp_steps=3, prefix_cache=False), second, 24)
    assert cached == 20
    assert torch.allclose(cached_k, fresh_k, atol=1e-4), (cached_k - fresh_k).abs().amax(dim=(1, 2))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("mtp", [0, 3])
def test_a_pool_too_small_to_keep_everything_evicts_mid_run(overlap, mtp):
    """A pool that holds a few requests at a time: the tree gives pages back (LRU, unlocked leaves only)
    while requests run on cached prefixes, and nothing changes in the tokens."""
    prompts = [SYSTEM[:20 + 3 * i] + [i] * 6 for i in range(12)] * 2
    want = LLM(page_size=4, overlap=False, mtp_steps=mtp, prefix_cache=False).generate(prompts, PARAMS)
    llm = LLM(page_size=4, overlap=overlap, mtp_steps=mtp, num_pages=40, max_running=4, hazard_check=True)
    evicted = []
    evict = llm.runner.cache.tree.evict
    llm.runner.allocator.reclaim = lambda n: evicted.append(n) or evict(n)
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert evicted, "the pool never ran short: the test proves nothing"
    assert any(o.cached_tokens for o in outs)
    llm.check_integrity()
    assert llm.runner.free_pages == llm.runner.usable_pages


def abort_when(llm: LLM, prompts: list[list[int]], victim: int, when: str) -> list:
    """Stream the prompts and abort request `victim` (its uid) at a point of its life: queued (before the
    stream starts), with its prefill in flight (as soon as that step is launched: the overlap loop
    receives the abort before it handles the step), or running (at its first reply)."""
    launch, outs = llm.scheduler.launch, []

    def launch_then_abort(batch):
        out = launch(batch)
        if batch.mode is ForwardMode.EXTEND and victim in [r.uid for r in batch.reqs]:
            llm.abort(victim)
        return out

    if when == "in flight":
        llm.scheduler.launch = launch_then_abort
    stream = llm.stream(prompts, PARAMS)
    if when == "queued":
        llm.abort(victim)
    for reply in stream:
        if when == "running" and reply.uid == victim and not reply.finished:
            llm.abort(victim)
            when = "done"
        outs.append(reply)
    llm.scheduler.launch = launch
    return outs


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("mtp", sampled([0, 3], [0]))
@pytest.mark.parametrize("when", ["queued", "in flight", "running"])
def test_aborts_leave_the_engine_as_good_as_new(overlap, mtp, when):
    """An abort queued, with its prefill (a hit) in flight, or running: it inserts nothing twice, holds no
    lock, and afterwards the engine serves the same prompts as a fresh one does."""
    llm = LLM(page_size=4, overlap=overlap, mtp_steps=mtp, max_running=2, hazard_check=True)
    prompts = [SYSTEM + [1, 2], SYSTEM + [3, 4], SYSTEM[:30] + [5] * 8]
    llm.generate(prompts[:1], PARAMS)                       # the system prompt is cached: the others hit
    uid = llm.next_uid + (2 if when == "queued" else 1)     # queued: the third waits for a slot
    replies = abort_when(llm, prompts, uid, when)
    assert [r.finish_reason for r in replies if r.uid == uid][-1] == "abort"
    llm.check_integrity()
    assert all(n.lock == 0 for n in llm.runner.cache.tree.nodes()), "a lock outlived its request"
    fresh = LLM(page_size=4, overlap=overlap, mtp_steps=mtp, max_running=2, prefix_cache=False)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == [o.token_ids for o in fresh.generate(prompts, PARAMS)]
    llm.check_integrity()


def test_the_fence_orders_the_rewrite_of_a_running_row():
    """Two requests with one prompt prefill together; when the first one's prompt is cached, the second's
    own copies are duplicates: its row is rewritten to the tree's pages while the next step, already
    launched in the overlap loop, reads that row. The fence orders the write after the read; without it
    (and with slot release deferred, so that this is the only write left unguarded) the checker names it."""
    prompts = [SYSTEM + [1], SYSTEM + [1]]
    llm = LLM(page_size=4, hazard_check=True)
    llm.generate(prompts, PARAMS)
    llm.check_integrity()
    unfenced = LLM(page_size=4, hazard_check=True, guards=Guards(fence=False, defer_release=True))
    with pytest.raises(HazardError, match=r"req_to_token row \d+, positions 0\.\.\d+: write on the schedule stream "
                                          r"\(step 2: the scheduler writes the KV slots of row"):
        unfenced.generate(prompts, PARAMS)


def test_a_stream_left_early_frees_its_locks():
    llm = LLM(page_size=4)
    llm.generate([SYSTEM + [1]], PARAMS)
    for reply in llm.stream([SYSTEM + [2], SYSTEM + [3]], PARAMS):
        break
    llm.check_integrity()
    assert llm.runner.cache.tree.evictable_pages == llm.runner.cache.tree.cached_pages
    assert llm.runner.free_pages == llm.runner.usable_pages


# ---- the tree on its own
def tree(num_pages: int = 32, page_size: int = 2) -> RadixCache:
    return RadixCache(PageAllocator(num_pages, page_size))


def test_match_and_insert_are_whole_pages():
    cache = tree()
    pages = cache.allocator.alloc(3)
    held, path, node = cache.insert([1, 2, 3, 4, 5, 6], pages)
    assert (held, path) == (0, pages)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7])[0] == pages, "a partial last page is never matched"
    assert cache.match_prefix([1, 2, 3, 9, 9])[0] == pages[:1], "a page that differs anywhere is not matched"
    other = cache.allocator.alloc(3)
    held, path, _ = cache.insert([1, 2, 3, 4, 8, 8], other)
    assert held == 2 and path == pages[:2] + other[2:], "the first two pages were held: the caller's copies are duplicates"
    assert cache.cached_pages == cache.evictable_pages == 4
    assert not cache.problems([])


def test_eviction_takes_unlocked_leaves_least_recently_used_first_and_never_a_locked_one():
    cache = tree()
    a, b, c = (cache.allocator.alloc(2) for _ in range(3))
    cache.insert([1, 1, 2, 2], a)
    _, _, node_b = cache.insert([3, 3, 4, 4], b)
    cache.insert([5, 5, 6, 6], c)
    cache.match_prefix([1, 1, 2, 2, 0])                       # a is used again: c is now the oldest
    cache.lock(node_b)
    free = cache.allocator.num_free
    cache.evict(2)
    assert cache.allocator.num_free == free + 2 and cache.match_prefix([5, 5, 6, 6, 0])[0] == []
    cache.evict(100)
    assert cache.match_prefix([3, 3, 4, 4, 0])[0] == b, "a locked path is never evicted"
    assert cache.cached_pages == 2 and cache.evictable_pages == 0
    assert not cache.problems([node_b])
    cache.unlock(node_b)
    assert cache.problems([node_b]), "the check sees a lock count that disagrees with the running requests"


# ---- the server
def hit_rate(url: str) -> float:
    """/metrics' minioverlap:cache_hit_rate."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text)
    return next(s.value for f in families for s in f.samples if s.name == "minioverlap:cache_hit_rate")


@pytest.mark.process
def test_the_server_reports_cached_tokens_in_openais_usage_field():
    """The second chat with the same system prompt is served partly from the cache: OpenAI's
    usage.prompt_tokens_details.cached_tokens says how much, streamed or not, and the text is the same;
    with --no-prefix-cache it is 0. /metrics' cache_hit_rate is the cached prompt tokens over all."""
    import openai
    from tests.serving import Server

    messages = [{"role": "system", "content": "You are a careful Python tutor. Answer with code only."},
                {"role": "user", "content": "Write fibonacci."}]
    for flag, cached in (("--prefix-cache", True), ("--no-prefix-cache", False)):
        server = Server(flag)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
            first, second = (client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
                             for _ in range(2))
            chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            hit = (first.usage.prompt_tokens - 1) // 16 * 16 if cached else 0
            assert second.usage.prompt_tokens_details.cached_tokens == hit
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit
            assert second.choices[0].message.content == first.choices[0].message.content
            report = server.integrity()
            assert report["problems"] is None
            prompts = 3 * first.usage.prompt_tokens                # /metrics' hit rate: cached / prompt tokens
            assert hit_rate(server.url) == pytest.approx(2 * hit / prompts)
        finally:
            code, out = server.stop()
        assert code == 0, out


@pytest.mark.parametrize("overlap, mtp", LOOPS)
def test_repetition_penalty_counts_a_prompt_the_prefix_cache_served(engines, overlap, mtp):
    """Chapter 16's repetition penalty, with the prefix cache. A prompt whose first pages the prefix cache served is never written whole into token_pool (its
    prefill runs only the rest), so the row holds the previous owner's tokens there: the penalty must
    still count the prompt's own."""
    llm = engines(overlap, mtp)
    shared = llm.processor.encode("".join(CODE_PROMPTS))[:32]           # 2 pages of 16: all but the last prompt token
    llm.generate([shared + [929, 605]], SamplingParams(max_tokens=4))   # their pages into the cache (MTP's key: pairs)
    llm.generate([[5] * 60], SamplingParams(max_tokens=2))              # another request's tokens in the row
    prompt = shared + [929]
    out = llm.generate([prompt], SamplingParams(max_tokens=32, repetition_penalty=2.0))[0]
    assert out.cached_tokens == 32
    assert out.token_ids == hf_generate(tuple(prompt), 32, repetition_penalty=2.0)
    llm.check_integrity()
