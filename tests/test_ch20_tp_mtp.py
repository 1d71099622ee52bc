"""Chapter 20: MTP speculative decoding over tensor-parallel ranks. The MTP layer is sharded as the target's
layers are (parallel/mtp.py): on one rank it is the plain MTP layer bit for bit, on 2 and 4 ranks its draft
logits are one device's within 1e-4, and rank 1's shard is the checkpoint's slice. An engine of two ranks with
mtp_steps=3 gives one device's greedy tokens in both loops, with the same drafts accepted (the same
verify_steps), the hazard checker on every rank; a stream left early leaves it as good as a fresh engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safetensors import safe_open

from conftest import no_hang, over_ranks
from minioverlap import LLM, SamplingParams
from minioverlap.model.loader import load_model, resolve_model_dir
from minioverlap.model.mtp import load_mtp
from minioverlap.parallel.group import TPGroup, init_group
from minioverlap.parallel.loader import load_tp_model
from minioverlap.parallel.mtp import TPMTPLayer, load_tp_mtp
from minioverlap.reference.contiguous import ContiguousCache
from test_ch20_tp_model import PROMPT, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = resolve_model_dir("tiny")
PROMPTS = ["import os\n" * 12, "x = [1, 2, 3]\nprint(x)\n" * 3, "def fibonacci(n):", [5, 6, 7],
           "class Stack:\n    def __init__(self):"]
PARAMS = [SamplingParams(max_tokens=n) for n in (24, 20, 16, 1, 12)]
OPTIONS = dict(mtp_steps=3, max_running=2, chunked_prefill_size=16, max_seq_len=128)   # requests queue; chunks
RUN_S = 120                                                # no run of these tests may take longer


def draft_logits(model, mtp) -> torch.Tensor:
    """The MTP layer's fp32 logits [T, vocab] over the prompt (row p reads token p+1 and the target's hidden
    state at p), in two passes over its cache: the first 8 rows, then the rest attending to them."""
    ids = torch.tensor(PROMPT) % model.config.vocab_size
    positions = torch.arange(len(PROMPT))
    with torch.inference_mode():
        hidden = model(ids, positions, ContiguousCache(model, len(PROMPT)))
        cache, out = ContiguousCache(model, len(PROMPT)), []
        for rows in (slice(0, 8), slice(8, None)):
            out.append(mtp.compute_logits(mtp(ids.roll(-1)[rows], hidden[rows], positions[rows], cache)))
            cache.length += len(positions[rows])
        return torch.cat(out)


def rank_main(rank: int, world_size: int, init_method: str, out_dir: Path, other: Path) -> None:
    """One rank: load the tiny model's shards and its MTP layer's, write the draft logits to out_dir/rank{rank}.pt."""
    torch.set_num_threads(1)
    group = init_group(rank, world_size, init_method, "cpu", timeout_s=60)
    try:
        model = load_tp_model(TINY, torch.float32, "cpu", group)
        mtp = load_tp_mtp(TINY, model, group)
        torch.save({"logits": draft_logits(model, mtp), "kv_heads": mtp.self_attn.k_proj.weight.shape[0] // 64},
                   out_dir / f"rank{rank}.pt")
    finally:
        group.destroy()


@pytest.fixture(scope="module")
def one_device_drafter() -> torch.Tensor:
    model = load_model(TINY, torch.float32, "cpu")
    return draft_logits(model, load_mtp(TINY, model))


def test_one_rank_s_mtp_layer_is_the_plain_one_bit_for_bit(one_device_drafter):
    """With TPGroup.single(), the sharded MTP layer holds the plain one's parameters and gives its logits exactly."""
    model = load_tp_model(TINY, torch.float32, "cpu", TPGroup.single())
    mtp = load_tp_mtp(TINY, model, TPGroup.single())
    assert isinstance(mtp, TPMTPLayer)
    assert sorted(mtp.state_dict()) == sorted(load_mtp(TINY, load_model(TINY, torch.float32, "cpu")).state_dict())
    assert torch.equal(draft_logits(model, mtp), one_device_drafter)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_draft_with_one_device_s_logits(tp_size, tmp_path, one_device_drafter):
    """On 2 ranks (KV heads split) and 4 (KV heads copied), every rank's draft logits are whole, equal to
    one device's within 1e-4 and to rank 0's exactly (every rank drafts the same tokens)."""
    seen = run_ranks(tp_size, tmp_path, tmp_path, main=rank_main)
    for rank, out in enumerate(seen):
        diff = (out["logits"] - one_device_drafter).abs().max().item()
        assert out["logits"].shape == one_device_drafter.shape and diff < 1e-4, f"tp {tp_size} rank {rank}: {diff}"
        assert torch.equal(out["logits"], seen[0]["logits"]) and out["kv_heads"] == max(1, 2 // tp_size)
    print(f"tp {tp_size}: max |draft logits - one device| = "
          f"{max((o['logits'] - one_device_drafter).abs().max().item() for o in seen):.2e}")


def test_rank_1_holds_the_checkpoint_s_slice_of_the_mtp_layer():
    """Rank 1 of 2 reads the second half of the MTP layer's query heads, KV heads and MLP columns, and the
    whole eh_proj and norms (loading needs no collective, so one process can play rank 1)."""
    group = TPGroup(tp_rank=1, tp_size=2)
    mtp = load_tp_mtp(TINY, load_tp_model(TINY, torch.float32, "cpu", group), group)
    prefix = "model.layers.6."
    with safe_open(TINY / "model.safetensors", "pt") as f:
        full = {name: f.get_tensor(prefix + name).float() for name in mtp.state_dict()}
    state = mtp.state_dict()
    assert torch.equal(state["self_attn.q_proj.weight"], full["self_attn.q_proj.weight"][128:256])
    assert torch.equal(state["self_attn.k_proj.weight"], full["self_attn.k_proj.weight"][64:128])
    assert torch.equal(state["self_attn.o_proj.weight"], full["self_attn.o_proj.weight"][:, 128:256])
    assert torch.equal(state["mlp.down_proj.weight"], full["mlp.down_proj.weight"][:, 384:768])
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        assert torch.equal(state[name], full[name]), name


# ---- the engine over two ranks


def outputs_of(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[tuple[list[int], int]]:
    """Each request's tokens and verify steps (target passes: the same drafts accepted, the same count)."""
    with no_hang(RUN_S):
        return [(o.token_ids, o.verify_steps) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def one_device() -> list[tuple[list[int], int]]:
    return outputs_of(LLM(overlap=False, **OPTIONS))


@pytest.fixture(scope="module", params=["normal", "overlap"])
def tp2(request):
    """Two ranks drafting with the MTP layer, the hazard checker on each."""
    with over_ranks(tp_size=2, overlap=request.param == "overlap", hazard_check=True, **OPTIONS) as llm:
        yield llm


def test_greedy_tokens_and_verify_steps_equal_one_device(tp2, one_device):
    """Twice (the second run hits the prefix cache): one device's tokens and verify steps, and drafts accepted."""
    assert outputs_of(tp2) == one_device
    assert outputs_of(tp2) == one_device
    assert one_device[0][1] < len(one_device[0][0]), "the repetitive prompt's drafts must be accepted"
    tp2.check_integrity()


def test_seeded_sampling_with_mtp_equals_one_device(tp2):
    """Every rank draws the same coins from the request's generator. Prompts shorter than a chunk: a chunk's
    step draws a token too, so a prompt cached in part (fewer chunks) would draw another stream."""
    prompts, params = PROMPTS[2::2], [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in (1, 2)]
    assert outputs_of(tp2, prompts, params) == outputs_of(LLM(overlap=False, **OPTIONS), prompts, params)


def test_a_stream_left_early_leaves_the_ranks_as_fresh(tp2, one_device):
    """A stream is left after its first tokens (requests running, others queued): every rank abandons the run,
    drafter state included, and the next run is a fresh engine's."""
    with no_hang(RUN_S):
        for reply in tp2.stream(PROMPTS, PARAMS):
            if reply.token_ids:
                break
    tp2.check_integrity()
    assert outputs_of(tp2) == one_device
