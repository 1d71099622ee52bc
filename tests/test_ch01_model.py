"""Chapter 01: the Qwen3 decoder and its loader produce transformers' tokens, and refuse bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import CODE_PROMPTS, TINY, _hf_model, hf_greedy, random_checkpoint, run_example
from minioverlap import LLM, SamplingParams
from minioverlap.reference.contiguous import ContiguousCache
from minioverlap.model.loader import CheckpointError
from minioverlap.model.qwen3 import RMSNorm, apply_rope, attention, rope_cos_sin


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM(model="tiny")


def test_tiny_greedy_tokens_equal_transformers(tiny, tiny_dir):
    """Greedy tokens of the shipped model equal transformers' generate, token for token, on code prompts."""
    outs = tiny.generate(CODE_PROMPTS, SamplingParams(max_tokens=40))
    for prompt, out in zip(CODE_PROMPTS, outs):
        ref = hf_greedy(tiny_dir, out.prompt_token_ids, 40, tiny.config.eos_token_ids)
        assert out.token_ids == ref, f"prompt {prompt!r}"


SHAPES = {
    "gqa-4to1-tied": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    "mha-wide-head-untied-sharded": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=48, shard_size="60KB"),
    "gqa-3to1-bf16": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, dtype=torch.bfloat16),
    "mqa-fp16-3-layers": dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3, dtype=torch.float16),
}


@pytest.mark.parametrize("name", SHAPES)
def test_random_checkpoint_tokens_equal_transformers(name, tmp_path):
    """Checkpoints that transformers writes itself, in other shapes and dtypes, load and decode identically."""
    path = random_checkpoint(tmp_path / name, seed=len(name), **SHAPES[name])
    if "sharded" in name:
        assert (path / "model.safetensors.index.json").is_file(), "the sharded case must really be sharded"
    llm = LLM(model=str(path))
    prompts = [[5, 17, 42, 9], [200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    for out in llm.generate(prompts, SamplingParams(max_tokens=24)):
        assert out.token_ids == hf_greedy(path, out.prompt_token_ids, 24)


def test_rope_matches_transformers():
    """apply_rope rotates q and k exactly as transformers' apply_rotary_pos_emb does."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    T, H, D = 7, 3, 32
    q, k = torch.randn(T, H, D), torch.randn(T, H, D)
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 100])
    rotary = Qwen3RotaryEmbedding(Qwen3Config(head_dim=D, hidden_size=H * D, num_attention_heads=H))
    cos_ref, sin_ref = rotary(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_ref, sin_ref)
    cos, sin = rope_cos_sin(positions, D, 10000.0)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref[0].transpose(0, 1))
    assert not torch.allclose(apply_rope(q, cos, sin)[3:], q[3:]), "positions > 0 must rotate"


@pytest.mark.parametrize("q_start", [0, 5])
def test_gqa_attention_matches_sdpa(q_start):
    """attention() equals PyTorch's causal SDPA with each KV head shared by a group of query heads."""
    torch.manual_seed(q_start)
    T, Hq, Hkv, D = 4, 6, 2, 16
    S = q_start + T
    q, k, v = torch.randn(T, Hq, D), torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
    mask = torch.arange(S)[None, :] <= torch.arange(q_start, S)[:, None]       # query i sees keys <= its position
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                         v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, q_start), ref.transpose(0, 1))


def test_decoding_with_the_cache_equals_recomputing_the_sequence(tiny):
    """Logits from prefill + one-token decode steps equal a single pass over the whole sequence."""
    model = tiny.model
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor(tiny.encode("def add(a, b):\n    return a + b\n"), device=device)
    with torch.inference_mode():
        full = model.compute_logits(model(ids, torch.arange(len(ids), device=device), ContiguousCache(model, len(ids))))
        cache, split = ContiguousCache(model, len(ids)), 6
        steps = [model(ids[:split], torch.arange(split, device=device), cache)]
        cache.length = split
        for pos in range(split, len(ids)):
            steps.append(model(ids[pos:pos + 1], torch.tensor([pos], device=device), cache))
            cache.length += 1
        stepwise = model.compute_logits(torch.cat(steps))
    torch.testing.assert_close(stepwise, full, rtol=1e-4, atol=1e-4)


def test_tiny_writes_python(tiny):
    """The shipped model continues a function header with an indented body, as Python needs."""
    out = tiny.generate("def fibonacci(n):", SamplingParams(max_tokens=32))[0]
    assert out.text.startswith("\n    "), repr(out.text)


def test_eos_stops_unless_ignored(tmp_path):
    """A request stops at EOS with finish_reason 'stop'; with ignore_eos it runs to max_tokens ('length')."""
    path = random_checkpoint(tmp_path / "m")
    first = LLM(model=str(path)).generate([[7, 8, 9]], SamplingParams(max_tokens=5))[0].token_ids[0]
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": first}))
    llm = LLM(model=str(path))
    stopped = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=5))[0]
    assert (stopped.token_ids, stopped.finish_reason) == ([first], "stop")
    ignored = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert (len(ignored.token_ids), ignored.finish_reason) == (5, "length")


def test_context_limit_stops_with_length(tiny):
    """A request that reaches max_seq_len stops there with finish_reason 'length', however large max_tokens is."""
    llm = LLM(model="tiny", max_seq_len=12)
    out = llm.generate([[10, 11, 12, 13, 14, 15, 16, 17]], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")


# ---- the loader refuses what it cannot load, naming the file, the tensor and the shape ----

def test_unknown_model_name_is_refused():
    """A name that is neither shipped nor a directory is refused, listing what is shipped."""
    with pytest.raises(ValueError, match=r"model='no-such-model'.*tiny"):
        LLM(model="no-such-model")


def test_directory_without_config_is_refused(tmp_path):
    """A directory with no config.json is refused with that file named."""
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=str(tmp_path))


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    """Deleting one tensor: the error names it and the shape the config implies."""
    path = random_checkpoint(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' with shape \[128, 64\] is missing"):
        LLM(model=str(path))


def test_shape_mismatch_names_file_tensor_and_expected_shape(tmp_path):
    """A config that disagrees with the weights: the error names the file, the tensor and both shapes."""
    path = random_checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                              r"has shape \[128, 64\], config.json implies \[96, 64\]"):
        LLM(model=str(path))


def test_unexpected_tensor_is_refused(tmp_path):
    """A tensor the config does not describe is an error, not silently skipped."""
    path = random_checkpoint(tmp_path / "m")
    tensors = load_file(path / "model.safetensors") | {"model.layers.0.self_attn.rogue.weight": torch.zeros(2)}
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.rogue.weight'"):
        LLM(model=str(path))


def test_missing_shard_is_named(tmp_path):
    """A sharded index that lists a file that is not there: the error names the file."""
    path = random_checkpoint(tmp_path / "m", shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        LLM(model=str(path))


def test_other_architectures_are_refused(tmp_path):
    """A config.json of another model type is refused by name."""
    path = random_checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama', expected 'qwen3'"):
        LLM(model=str(path))


# ---- bad requests: a ValueError naming the field and the limit ----

@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 4096], r"token id 4096 is outside the vocabulary \[0, 4096\)"),
    ([-1], r"token id -1 is outside the vocabulary"),
    ([1] * 1024, "prompt has 1024 tokens; the context holds 1024"),
])
def test_bad_prompts_are_refused(tiny, prompt, message):
    """Each bad prompt raises a ValueError that names the problem and the limit."""
    with pytest.raises(ValueError, match=message):
        tiny.generate([prompt], SamplingParams(max_tokens=4))


def test_one_bad_prompt_refuses_the_call_before_any_work(tiny):
    """Prompts are all checked first: a bad one in a list raises, and no request is numbered or run."""
    before = tiny.next_uid
    with pytest.raises(ValueError):
        tiny.generate([[1, 2], [99999]], SamplingParams(max_tokens=4))
    assert tiny.next_uid == before
    assert tiny.generate([[1, 2]], SamplingParams(max_tokens=4))[0].uid == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float64"), "dtype must be one of float32, bfloat16, float16, got 'float64'"),
    (dict(device="tpu"), "device must be 'cpu' or 'cuda'"),
    (dict(max_seq_len=5000), r"max_seq_len must be an integer in \[2, 1024\]"),
])
def test_bad_engine_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="tiny", **kwargs)


def test_tied_head_written_anyway_must_equal_the_embedding(tmp_path):
    """A tied config whose file also holds lm_head.weight loads only if that tensor equals the embedding."""
    path = random_checkpoint(tmp_path / "m", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    save_file(tensors | {"lm_head.weight": embed.clone()}, path / "model.safetensors")
    out = LLM(model=str(path)).generate([[3, 4]], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == hf_greedy(path, [3, 4], 8), "an equal lm_head.weight loads, and decodes as transformers does"
    save_file(tensors | {"lm_head.weight": embed + 1}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        LLM(model=str(path))


# ---- what the loader reads from config.json, and RMSNorm where eps decides

class WholeSequence:
    """An attention context for one pass over a whole sequence: causal SDPA over the pass's own K/V."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


@pytest.mark.parametrize("naming", ["rope_parameters", "top-level rope_theta"])
def test_loader_uses_rope_theta_rms_norm_eps_and_norm_weights(tmp_path, naming):
    """A checkpoint with rope_theta=1e6, rms_norm_eps=0.05 and norm weights far from ones gives transformers'
    logits and greedy tokens: the loader takes all three from the checkpoint (rope_theta under either
    naming: transformers 5's rope_parameters, or 4.x's top-level key), not from the defaults."""
    path = random_checkpoint(tmp_path / "m", rope_theta=1e6, rms_norm_eps=0.05, norm_noise=0.5)
    config = json.loads((path / "config.json").read_text())
    assert config["rms_norm_eps"] == 0.05 and config["rope_parameters"]["rope_theta"] == 1e6
    if naming == "top-level rope_theta":
        del config["rope_parameters"]
        (path / "config.json").write_text(json.dumps(config | {"rope_theta": 1e6}))
    ref_model = _hf_model(str(path))
    assert ref_model.config.rope_parameters["rope_theta"] == 1e6, "the reference itself runs at theta 1e6"
    assert not torch.all(ref_model.model.norm.weight == 1), "the norm weights in the file are not all ones"
    prompt = [(7 * i + 3) % 300 for i in range(48)]              # long: RoPE's slow pairs turn visibly by then
    with torch.inference_mode():
        ref = ref_model(torch.tensor([prompt])).logits[0]
        model = LLM(model=str(path)).model
        device = model.model.embed_tokens.weight.device                # the test device (conftest)
        ours = model.compute_logits(model(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device),
                                          WholeSequence()))
    torch.testing.assert_close(ours.cpu(), ref, rtol=1e-4, atol=1e-4)
    out = LLM(model=str(path)).generate([prompt[:20]], SamplingParams(max_tokens=24))[0]
    assert out.token_ids == hf_greedy(path, prompt[:20], 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_transformers_on_zero_and_tiny_inputs(dtype):
    """RMSNorm equals transformers' Qwen3RMSNorm where eps decides: a zero row gives 0 (not NaN), a row of
    1e-5s gives weight * 1e-5 / sqrt(1e-10 + eps), about weight / 100 (eps inside the square root), not
    weight * 1.0; small and ordinary rows match too."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    dim, eps = 16, 1e-6
    ours, ref = RMSNorm(dim, eps), Qwen3RMSNorm(dim, eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)          # weights in the input's dtype, as the engine holds them
    x = torch.stack([torch.zeros(dim), torch.full((dim,), 1e-5), 1e-4 * torch.randn(dim), torch.randn(dim),
                     100 * torch.randn(dim)]).to(dtype)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[0], torch.zeros(dim)), "a zero row normalises to zero"
    by_hand = ours.weight.detach().float() * (1e-5 / (1e-10 + eps) ** 0.5)        # 0.0099995 * weight
    torch.testing.assert_close(out[1].float(), by_hand, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)


@pytest.mark.process
def test_the_example_completes_the_prompt_with_transformers_tokens():
    """`python examples/ch01_model.py` prints the prompt's ids, a completion that starts with the prompt,
    and says that its 48 tokens equal transformers' greedy tokens."""
    out = run_example("examples/ch01_model.py")
    assert "prompt: 'def fibonacci(n):' -> 9 tokens [" in out
    assert "completion:\ndef fibonacci(n):\n" in out and "finish_reason: length" in out
    assert "tokens equal transformers' Qwen3ForCausalLM.generate: True (48 of 48)" in out


def test_every_option_of_the_command_line_says_what_it_does():
    """`minioverlap COMMAND --help` explains every argument: none is left without help text."""
    import argparse

    from minioverlap.cli import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = [f"{name} {action.dest}" for name, command in commands.items() for action in command._actions
            if not action.help]
    assert "generate" in commands and bare == []


@pytest.mark.process
def test_the_command_line_names_a_broken_config_json_and_prints_no_traceback(tmp_path):
    """A checkpoint whose config.json is not JSON: `minioverlap generate` exits with status 2 and one
    error line that names the file, not a Python traceback."""
    import subprocess
    import sys

    model = tmp_path / "broken"
    model.mkdir()
    for path in TINY.iterdir():
        (model / path.name).symlink_to(path)
    (model / "config.json").unlink()
    (model / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 4096,')     # cut short
    run = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", "--model", str(model)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "error:" in run.stderr and str(model / "config.json") in run.stderr.replace("\n", "")
    assert "Traceback" not in run.stderr + run.stdout
