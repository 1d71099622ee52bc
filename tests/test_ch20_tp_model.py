"""Chapter 20: the tensor-parallel model, loaded as shards on 2 and 4 ranks, computes the single-device
model's logits and tokens; the sharding rules cut each weight where the field cuts it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from safetensors.torch import load_file, save_file

from conftest import random_checkpoint
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.model.loader import CheckpointError, load_config, load_model, resolve_model_dir
from minioverlap.parallel.group import TPGroup, init_group
from minioverlap.parallel.layers import kv_head_range, shard_range, vocab_range
from minioverlap.parallel.loader import load_tp_model
from minioverlap.parallel.model import TPQwen3ForCausalLM, rank_config
from minioverlap.reference.contiguous import ContiguousCache, greedy_generate
from minioverlap.reference.paged_greedy import paged_greedy_generate

PROMPT = [5, 17, 42, 9, 100, 3, 2048, 4095, 0, 2047, 1500, 77]     # ids in every rank's vocabulary slice
NEW_TOKENS = 8
RANKS_TIMEOUT_S = 120


def prompt_logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's final hidden states [T, hidden] and fp32 logits [T, vocab], in one prefill."""
    ids = torch.tensor(PROMPT) % model.config.vocab_size
    positions = torch.arange(len(PROMPT))
    with torch.inference_mode():
        hidden = model(ids, positions, ContiguousCache(model, len(PROMPT)))
        return hidden, model.compute_logits(hidden)


def rank_main(rank: int, world_size: int, init_method: str, out_dir: Path, other: Path) -> None:
    """One rank: load the tiny model's shards, run the prompt and greedy decoding (contiguous and paged),
    sum a bf16 tensor over the group; load the other checkpoint's shards and run the prompt; write what
    it saw to out_dir/rank{rank}.pt."""
    torch.set_num_threads(1)
    group = init_group(rank, world_size, init_method, "cpu", timeout_s=60)
    try:
        model = load_tp_model(resolve_model_dir("tiny"), torch.float32, "cpu", group)
        hidden, logits = prompt_logits(model)
        runner = ModelRunner(model, num_pages=None, page_size=4, max_running=2, max_seq_len=64)
        seen = {"hidden": hidden, "logits": logits, "kv_heads": runner.kv_pool.k[0].shape[1],
                "contiguous": greedy_generate(model, PROMPT, NEW_TOKENS),
                "paged": paged_greedy_generate(runner, PROMPT, NEW_TOKENS),
                "bf16_sum": group.all_reduce(torch.full((4,), rank + 1.0, dtype=torch.bfloat16)),
                "inbox": group.broadcast_object(["request", rank] if rank == 0 else None),
                "other_logits": prompt_logits(load_tp_model(other, torch.float32, "cpu", group))[1]}
        torch.save(seen, out_dir / f"rank{rank}.pt")
    finally:
        group.destroy()


def run_ranks(world_size: int, tmp_path: Path, other: Path, main=rank_main) -> list[dict]:
    """Spawn world_size ranks of main; a rank's exception fails the test with its traceback, and ranks still
    running after RANKS_TIMEOUT_S are killed."""
    ranks = mp.spawn(main, args=(world_size, f"file://{tmp_path / 'rendezvous'}", tmp_path, other),
                     nprocs=world_size, join=False)
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        while not ranks.join(timeout=1.0):                   # raises ProcessRaisedException for a failed rank
            if time.monotonic() > deadline:
                pytest.fail(f"{world_size} ranks still running after {RANKS_TIMEOUT_S} s")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory) -> Path:
    """A random checkpoint unlike tiny: an untied LM head, 8 query heads on 4 KV heads, shards listed in
    an index, norms that are not ones, and a vocabulary of 517 tokens, which neither 2 nor 4 ranks divide
    (padded: the last rank holds fewer rows)."""
    return random_checkpoint(tmp_path_factory.mktemp("other"), seed=20, num_attention_heads=8, num_key_value_heads=4,
                             shard_size="60KB", norm_noise=0.1, vocab_size=517)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, other_checkpoint):
    """run_ranks(tp_size), run once per tp_size for the whole module."""
    runs: dict[int, list[dict]] = {}

    def run(tp_size: int) -> list[dict]:
        if tp_size not in runs:
            runs[tp_size] = run_ranks(tp_size, tmp_path_factory.mktemp(f"tp{tp_size}"), other_checkpoint)
        return runs[tp_size]

    return run


@pytest.fixture(scope="module")
def single_device(other_checkpoint) -> dict:
    """The single-device model's prompt logits and greedy tokens: what every rank must reproduce."""
    model = load_model(resolve_model_dir("tiny"), torch.float32, "cpu")
    hidden, logits = prompt_logits(model)
    other = prompt_logits(load_model(other_checkpoint, torch.float32, "cpu"))[1]
    return {"hidden": hidden, "logits": logits, "tokens": greedy_generate(model, PROMPT, NEW_TOKENS), "other_logits": other}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_compute_the_single_device_logits(tp_size, tp_run, single_device):
    """On 2 ranks (KV heads split) and 4 (KV heads copied), every rank's full-vocabulary logits equal
    the single-device model's within 1e-4 in fp32, and greedy decoding, contiguous or paged, gives its
    tokens; the KV pool holds only the rank's KV heads. The same for a checkpoint with an untied head,
    sharded files, 4 KV heads and a vocabulary the ranks do not divide."""
    seen = tp_run(tp_size)
    for rank, out in enumerate(seen):
        diff = (out["logits"] - single_device["logits"]).abs().max().item()
        assert out["logits"].shape == single_device["logits"].shape and out["logits"].dtype == torch.float32
        assert diff < 1e-4, f"tp {tp_size} rank {rank}: logits differ by {diff}"
        torch.testing.assert_close(out["hidden"], single_device["hidden"], atol=1e-4, rtol=0)
        assert torch.equal(out["logits"].argmax(-1), single_device["logits"].argmax(-1))
        assert out["contiguous"] == out["paged"] == single_device["tokens"], f"tp {tp_size} rank {rank}"
        assert out["kv_heads"] == max(1, 2 // tp_size)
        assert torch.equal(out["logits"], seen[0]["logits"]), "every rank must sample from the same scores"
        assert out["inbox"] == ["request", 0]
        torch.testing.assert_close(out["other_logits"], single_device["other_logits"], atol=1e-4, rtol=0)
    print(f"tp {tp_size}: max |logits - single device| = "
          f"{max((o['logits'] - single_device['logits']).abs().max().item() for o in seen):.2e}")


def test_tp_all_reduce_sums_bf16(tp_run):
    """A bf16 all-reduce over gloo sums the ranks' tensors (1 + 2 on two ranks)."""
    assert all(torch.equal(out["bf16_sum"], torch.full((4,), 3.0, dtype=torch.bfloat16)) for out in tp_run(2))


def rank_that_fails(rank: int, world_size: int, init_method: str, out_dir: Path, other: Path) -> None:
    """Rank 1 raises before it joins; rank 0 waits in init_group for a peer that never comes (up to the
    join's deadline, far past the test's 30 s). The join is not this test's subject: on two busy cores,
    gloo's connection of the group's pairs once failed ("Connection closed by peer") before rank 1 raised."""
    if rank == 1:
        raise RuntimeError("rank 1 cannot load its shard")
    init_group(rank, world_size, init_method, "cpu", timeout_s=60)


def test_a_failing_rank_fails_the_run_with_its_traceback(tmp_path):
    """A rank's exception ends the run at once, its traceback in the error, and no rank is left waiting."""
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 cannot load its shard"):
        run_ranks(2, tmp_path, tmp_path, main=rank_that_fails)
    assert time.monotonic() - started < 30


def test_shards_cut_heads_columns_and_vocabulary():
    """Rank 1 of 2 holds the second half of the query heads (q rows, o_proj columns), of the KV heads,
    of the MLP columns (gate/up rows, down_proj columns) and of the vocabulary; norms are whole."""
    config = load_config(resolve_model_dir("tiny"))          # 4 query heads, 2 KV heads, head_dim 64
    with torch.device("meta"):
        model = TPQwen3ForCausalLM(config, TPGroup(tp_rank=1, tp_size=2))
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight_slice[0] == slice(128, 256) and attn.o_proj.weight_slice[1] == slice(128, 256)
    assert attn.k_proj.weight_slice[0] == attn.v_proj.weight_slice[0] == slice(64, 128)
    assert mlp.gate_proj.weight_slice[0] == mlp.up_proj.weight_slice[0] == mlp.down_proj.weight_slice[1] == slice(384, 768)
    assert model.model.embed_tokens.weight_slice[0] == slice(2048, 4096)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tuple(attn.q_proj.weight.shape) == (128, 256) and tuple(mlp.down_proj.weight.shape) == (256, 384)
    assert tuple(layer.input_layernorm.weight.shape) == (256,) and not hasattr(layer.input_layernorm, "weight_slice")
    view = model.config
    assert (view.num_attention_heads, view.num_key_value_heads, view.intermediate_size, view.vocab_size) == (2, 1, 384, 4096)


def test_kv_heads_are_copied_when_tp_size_exceeds_them():
    """With 2 KV heads on 4 ranks, ranks 0-1 hold KV head 0 and ranks 2-3 head 1: the head their query
    heads read (query head h reads KV head h // (Hq // Hkv)), for 4 and for 8 query heads."""
    assert [kv_head_range(2, r, 4) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    for num_heads in (4, 8):
        for rank in range(4):
            q_heads = shard_range(num_heads, rank, 4)
            kv = kv_head_range(2, rank, 4)
            assert {h // (num_heads // 2) for h in range(q_heads.start, q_heads.stop)} == {kv.start}
    assert [kv_head_range(4, r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]


@pytest.mark.parametrize("tp_size, names", [(3, ["num_attention_heads (4)"]),
                                            (8, ["num_attention_heads (4)"])])
def test_a_tp_size_that_does_not_divide_the_heads_is_refused(tp_size, names):
    """tp_size must divide the query heads (and the MLP width; not the vocabulary, which is padded): a
    ValueError names tp_size and the counts, and not the vocabulary."""
    config = load_config(resolve_model_dir("tiny"))
    with pytest.raises(ValueError, match=rf"tp_size \({tp_size}\)") as error:
        rank_config(config, 0, tp_size)
    assert all(name in str(error.value) for name in names + ["num_key_value_heads 2"])
    assert "vocab" not in str(error.value)


@pytest.mark.parametrize("vocab_size, tp_size", [(517, 2), (517, 4), (517, 8), (4096, 4), (5, 4)])
def test_a_padded_vocabulary_gives_each_token_to_exactly_one_rank(vocab_size, tp_size):
    """The ranks' rows are consecutive, cover the vocabulary once, and each is at most P = ceil(V/N)
    long (the part the head pads its logits to); only the last ranks hold fewer."""
    rows = [vocab_range(vocab_size, r, tp_size) for r in range(tp_size)]
    assert [t for s in rows for t in range(s.start, s.stop)] == list(range(vocab_size))
    part = -(-vocab_size // tp_size)
    assert all(s.stop - s.start <= part for s in rows) and rows[0].stop - rows[0].start == min(part, vocab_size)


def test_one_rank_loads_the_single_device_model_exactly():
    """With TPGroup.single(), the sharded loader and the parallel layers give the single-device logits
    bit for bit: the parallel layers are the same arithmetic."""
    model = load_tp_model(resolve_model_dir("tiny"), torch.float32, "cpu", TPGroup.single())
    reference = load_model(resolve_model_dir("tiny"), torch.float32, "cpu")
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    assert torch.equal(prompt_logits(model)[1], prompt_logits(reference)[1])


def test_a_tensor_of_the_wrong_shape_is_refused_before_a_slice_is_read(tmp_path):
    """The sharded loader checks each tensor's full shape from the file's header, as load_model does:
    a k_proj with one KV head where config.json says two is a CheckpointError naming both shapes."""
    tiny = resolve_model_dir("tiny")
    tensors = load_file(tiny / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:64]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \[64, 256\], config.json implies \[128, 256\]"):
        load_tp_model(tmp_path, torch.float32, "cpu", TPGroup(tp_rank=1, tp_size=2))
