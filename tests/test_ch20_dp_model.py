"""Chapter 20: DP attention. On 2, 3 and 4 ranks, each with its own prompt of its own length, every rank's
logits for its prompt are the single-device model's; a rank with no tokens runs the empty batch and the
others still get their logits; greedy decoding of unequal batches, a rank going idle when its requests
finish, gives the single-device tokens. Attention is whole on every rank, only the MLP is split, and the
KV pool holds all the KV heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minioverlap.engine.model_runner import ModelRunner
from minioverlap.model.loader import load_config, load_model, resolve_model_dir
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.parallel.dp_attention import DPAttentionQwen3ForCausalLM, check_dp_size
from minioverlap.parallel.group import TPGroup, init_group
from minioverlap.parallel.loader import load_dp_model
from minioverlap.parallel.model import rank_config
from minioverlap.reference.contiguous import ContiguousCache, greedy_generate
from test_ch20_tp_model import PROMPT, run_ranks

TINY = resolve_model_dir("tiny")
PROMPTS = [PROMPT, [7, 300, 12, 2500, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [4000]]   # rank r's prompt: 12, 5, 9, 1 tokens
IDLE_RANK = 1
# Rank r's requests (prompt, new tokens), decoded in STEPS steps in step with the other ranks: rank 0 runs
# two at once, rank 1 finishes after 3 steps and is idle after, rank 2 has none, rank 3 one.
REQUESTS = [[(PROMPT, 6), ([9, 8, 7], 4)], [(PROMPTS[1], 3)], [], [(PROMPTS[3], 5)]]
STEPS = 6
NO_TOKENS = torch.empty(0, dtype=torch.long)
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def agree_max_tokens(group: TPGroup, num_tokens: int) -> int:
    """The most tokens any rank runs this step, as the ranks' schedulers agree on it before the step:
    every rank's count, gathered, and their maximum. Every rank must call it, an idle one too."""
    return int(group.all_gather(torch.tensor([num_tokens]), dim=0).max())


def prefill(model: DPAttentionQwen3ForCausalLM, group: TPGroup, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step in which this rank prefills `prompt` (none: the empty batch): its hidden [T, hidden] and
    fp32 logits [T, vocab]."""
    model.set_max_tokens(agree_max_tokens(group, len(prompt)))
    ids, positions = torch.tensor(prompt, dtype=torch.long), torch.arange(len(prompt))
    with torch.inference_mode():
        hidden = model(ids, positions, ContiguousCache(model, len(prompt)) if prompt else None)
        return hidden, model.compute_logits(hidden)


class Batch:
    """Several requests' contiguous caches as one attention context: the step's rows are theirs, in order."""

    def __init__(self, caches: list[ContiguousCache], sizes: list[int]) -> None:
        self.caches, self.sizes = caches, sizes

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = zip(*(t.split(self.sizes) for t in (q, k, v)))
        return torch.cat([cache.attend(layer_id, *qkv) for cache, qkv in zip(self.caches, parts)])


def decode_step(model: DPAttentionQwen3ForCausalLM, caches: list[ContiguousCache], inputs: list[list[int]]) -> list[int]:
    """One forward of several requests' tokens (a prompt, or the last token), each in its own cache: the
    greedy next token of each."""
    sizes = [len(ids) for ids in inputs]
    positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, sizes)])
    hidden = model(torch.tensor(sum(inputs, [])), positions, Batch(caches, sizes))
    for cache, n in zip(caches, sizes):
        cache.length += n
    last = torch.tensor(sizes).cumsum(0) - 1
    return model.compute_logits(hidden[last]).argmax(-1).tolist()


@torch.inference_mode()
def decode_in_step(model: DPAttentionQwen3ForCausalLM, group: TPGroup,
                   requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy decoding of this rank's requests over STEPS steps, every rank stepping together: each step
    the ranks agree on max_tokens, and a rank with nothing to run runs the empty batch."""
    caches = [ContiguousCache(model, len(prompt) + n) for prompt, n in requests]
    outs: list[list[int]] = [[] for _ in requests]
    for _ in range(STEPS):
        running = [i for i, (_, n) in enumerate(requests) if len(outs[i]) < n]
        inputs = [outs[i][-1:] or requests[i][0] for i in running]
        model.set_max_tokens(agree_max_tokens(group, sum(map(len, inputs))))
        if not running:
            model(NO_TOKENS, NO_TOKENS, None)
            continue
        for i, token in zip(running, decode_step(model, [caches[i] for i in running], inputs)):
            outs[i].append(token)
    return outs


def rank_main(rank: int, world_size: int, init_method: str, out_dir: Path, model_dir: Path) -> None:
    """One rank: load its DP model, prefill its own prompt (all ranks busy), then again with IDLE_RANK
    idle, then decode its requests; write what it saw to out_dir/rank{rank}.pt."""
    torch.set_num_threads(1)
    group = init_group(rank, world_size, init_method, "cpu", timeout_s=30)   # a hang fails within 30 s
    try:
        model = load_dp_model(model_dir, torch.float32, "cpu", group)
        runner = ModelRunner(model, num_pages=None, page_size=4, max_running=2, max_seq_len=64)
        seen = {"busy": prefill(model, group, PROMPTS[rank]),
                "idle": prefill(model, group, [] if rank == IDLE_RANK else PROMPTS[rank]),
                "tokens": decode_in_step(model, group, REQUESTS[rank]),
                "kv_heads": runner.kv_pool.k[0].shape[1]}
        torch.save(seen, out_dir / f"rank{rank}.pt")
    finally:
        group.destroy()


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """run_ranks(tp_size) of rank_main, run once per tp_size for the whole module."""
    runs: dict[int, list[dict]] = {}

    def run(tp_size: int) -> list[dict]:
        if tp_size not in runs:
            runs[tp_size] = run_ranks(tp_size, tmp_path_factory.mktemp(f"dp{tp_size}"), TINY, main=rank_main)
        return runs[tp_size]

    return run


@pytest.fixture(scope="module")
def single_device() -> Qwen3ForCausalLM:
    return load_model(TINY, torch.float32, "cpu")


def single_device_logits(model: Qwen3ForCausalLM, prompt: list[int]) -> torch.Tensor:
    """The prompt's fp32 logits [T, vocab] in one prefill, with no agreement: one device's, or one rank's."""
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), ContiguousCache(model, len(prompt)))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_each_rank_computes_the_single_device_logits_of_its_own_prompt(tp_size, dp_run, single_device):
    """Rank r prefills a prompt of its own length (12, 5, 9, 1 tokens): padded to the longest for the MLP's
    gather, its fp32 logits are the single-device model's for its prompt, and its KV pool holds all 2 KV
    heads (attention is whole). 3 ranks work too, though they divide neither the 4 query heads nor 2 KV heads."""
    for rank, out in enumerate(dp_run(tp_size)):
        hidden, logits = out["busy"]
        assert hidden.shape == (len(PROMPTS[rank]), 256) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, single_device_logits(single_device, PROMPTS[rank]), **TOLERANCE)
        assert out["kv_heads"] == 2


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_an_idle_rank_runs_the_empty_batch(tp_size, dp_run, single_device):
    """With rank 1 idle (no tokens, no attention context), it still joins every layer's gather and
    all-reduce: it returns no rows, and the other ranks get their single-device logits."""
    for rank, out in enumerate(dp_run(tp_size)):
        hidden, logits = out["idle"]
        if rank == IDLE_RANK:
            assert hidden.shape == (0, 256) and logits.shape == (0, 4096)
        else:
            torch.testing.assert_close(logits, single_device_logits(single_device, PROMPTS[rank]), **TOLERANCE)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_greedy_decoding_of_unequal_batches_gives_the_single_device_tokens(tp_size, dp_run, single_device):
    """Rank 0 decodes two requests at once, rank 1 one that finishes early (then idles), rank 2 none, rank 3
    one: every request's greedy tokens are the single-device model's."""
    for rank, out in enumerate(dp_run(tp_size)):
        expected = [greedy_generate(single_device, prompt, n) for prompt, n in REQUESTS[rank]]
        assert out["tokens"] == expected, f"dp {tp_size} rank {rank}"


@pytest.mark.parametrize("tp_size", [5, 7])
def test_a_tp_size_that_does_not_divide_the_mlp_width_is_refused(tp_size):
    """DP attention splits only the MLP: a tp_size that does not divide intermediate_size (768) is a
    ValueError naming both."""
    config = load_config(TINY)
    with pytest.raises(ValueError, match=rf"tp_size \({tp_size}\).*intermediate_size \(768\)"):
        check_dp_size(config, tp_size)
    with pytest.raises(ValueError, match=rf"tp_size \({tp_size}\)"):
        DPAttentionQwen3ForCausalLM(config, TPGroup(tp_rank=0, tp_size=tp_size))


def test_attention_is_whole_and_only_the_mlp_is_split():
    """Rank 1 of 3 (a tp_size TP refuses: 4 query heads) holds whole q/k/v/o_proj, embedding and head, and
    the middle third of the MLP columns; its config is the checkpoint's."""
    config = load_config(TINY)
    with pytest.raises(ValueError, match=r"tp_size \(3\)"):
        rank_config(config, 1, 3)
    with torch.device("meta"):
        model = DPAttentionQwen3ForCausalLM(config, TPGroup(tp_rank=1, tp_size=3))
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert model.config is model.full_config is config
    assert tuple(attn.q_proj.weight.shape) == (256, 256) and tuple(attn.k_proj.weight.shape) == (128, 256)
    assert not any(hasattr(m, "weight_slice") for m in (attn.q_proj, attn.o_proj, model.model.embed_tokens, model.lm_head))
    assert mlp.gate_proj.weight_slice[0] == mlp.up_proj.weight_slice[0] == mlp.down_proj.weight_slice[1] == slice(256, 512)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_one_rank_loads_the_single_device_model_exactly(single_device):
    """With TPGroup.single() the DP loader reads the single-device parameters, and without padding the
    logits are the single-device ones bit for bit; padded to more rows, they stay within fp32 rounding."""
    model = load_dp_model(TINY, torch.float32, "cpu", TPGroup.single())
    assert sorted(model.state_dict()) == sorted(single_device.state_dict())
    expected = single_device_logits(single_device, PROMPT)
    model.set_max_tokens(len(PROMPT))
    assert torch.equal(single_device_logits(model, PROMPT), expected)
    model.set_max_tokens(len(PROMPT) + 5)
    torch.testing.assert_close(single_device_logits(model, PROMPT), expected, **TOLERANCE)


def test_more_tokens_than_max_tokens_is_refused():
    """A rank with more tokens than the step's max_tokens (or before any set_max_tokens) cannot pad to it:
    a ValueError naming both counts, not a gather of mismatched shapes."""
    model = load_dp_model(TINY, torch.float32, "cpu", TPGroup.single())
    with pytest.raises(ValueError, match=r"12 tokens, more than max_tokens \(0\)"):
        single_device_logits(model, PROMPT)
    model.set_max_tokens(4)
    with pytest.raises(ValueError, match=r"12 tokens, more than max_tokens \(4\)"):
        single_device_logits(model, PROMPT)
