"""Chapter 01: a broken checkpoint is refused with a CheckpointError (a ValueError) that names the file and
the field, never a bare SafetensorError, KeyError, TypeError or JSONDecodeError from the libraries below.
Each case breaks one thing in a copy of a good random checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

import minioverlap
from conftest import TINY, random_checkpoint
from minioverlap import LLM, SamplingParams
from minioverlap.model.loader import CheckpointError, checkpoint_dtype

PROBE = [[3, 4, 5], [9, 8]]
DELETE = object()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = random_checkpoint(tmp_path_factory.mktemp("good") / "m", eos_token_id=[7])
    shutil.copy(TINY / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def engine(good) -> tuple[LLM, list[list[int]]]:
    """One engine on the good checkpoint, and its greedy tokens while it is fresh."""
    llm = LLM(model=str(good))
    return llm, [o.token_ids for o in llm.generate(PROBE, SamplingParams(max_tokens=6))]


def edit_json(name: str, **changes):
    """Set (or, with DELETE, remove) top-level fields of a JSON file of the checkpoint."""
    def apply(path: Path) -> None:
        raw = json.loads((path / name).read_text()) if (path / name).is_file() else {}
        for field, value in changes.items():
            if value is DELETE:
                del raw[field]
            else:
                raw[field] = value
        (path / name).write_text(json.dumps(raw))
    return apply


def write(name: str, data: bytes | str):
    def apply(path: Path) -> None:
        (path / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return apply


def truncate(name: str):
    def apply(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[:len(data) // 2])
    return apply


def shard_index(path: Path) -> None:
    """An index that puts model.norm.weight in a shard that holds another tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path / "model.safetensors", "pt") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    save_file({"other": torch.zeros(1)}, path / "extra.safetensors")
    weight_map["model.norm.weight"] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CASES = {
    "empty weights": (write("model.safetensors", b""), r"model\.safetensors: not a readable safetensors file"),
    "truncated weights": (truncate("model.safetensors"), r"model\.safetensors: not a readable safetensors file"),
    "garbage header": (write("model.safetensors", struct.pack("<Q", 12) + b"{not json!!}"),
                       r"model\.safetensors: not a readable safetensors file .*JSON"),
    "header length past the end": (write("model.safetensors", struct.pack("<Q", 2**40) + b"{}"),
                                   r"model\.safetensors: not a readable safetensors file"),
    "config not JSON": (write("config.json", "{'model_type': qwen3"), r"config\.json: not a readable JSON file"),
    "config not UTF-8": (write("config.json", b"\xff\xfe\x00"), r"config\.json: not a readable JSON file"),
    "config a list": (write("config.json", "[1, 2]"), r"config\.json: must hold a JSON object, got list"),
    "hidden_size missing": (edit_json("config.json", hidden_size=DELETE),
                            r"config\.json: required field 'hidden_size' is missing"),
    "vocab_size a string": (edit_json("config.json", vocab_size="300"),
                            r"config\.json: vocab_size must be an integer >= 1, got '300'"),
    "num_attention_heads a bool": (edit_json("config.json", num_attention_heads=True),
                                   r"config\.json: num_attention_heads must be an integer >= 1, got True"),
    "heads not a multiple of kv heads": (edit_json("config.json", num_key_value_heads=3),
                                         r"config\.json: num_attention_heads \(4\) must be a multiple of "
                                         r"num_key_value_heads \(3\)"),
    "max_position_embeddings 0": (edit_json("config.json", max_position_embeddings=0),
                                  r"config\.json: max_position_embeddings must be an integer >= 2 .*got 0"),
    "rms_norm_eps a string": (edit_json("config.json", rms_norm_eps="1e-6"),
                              r"config\.json: rms_norm_eps must be a finite number > 0, got '1e-6'"),
    "rope_parameters a string": (edit_json("config.json", rope_parameters="default"),
                                 r"config\.json: rope_parameters must be a JSON object, got 'default'"),
    "tie_word_embeddings a string": (edit_json("config.json", tie_word_embeddings="no"),
                                     r"config\.json: tie_word_embeddings must be true or false, got 'no'"),
    "eos_token_id a string": (edit_json("config.json", eos_token_id="7"),
                              r"config\.json: eos_token_id must be a token id or a list of token ids, got '7'"),
    "generation_config not JSON": (write("generation_config.json", "eos_token_id = 7"),
                                   r"generation_config\.json: not a readable JSON file"),
    "index without weight_map": (write("model.safetensors.index.json", "{}"),
                                 r"model\.safetensors\.index\.json: weight_map must map tensor names to file names"),
    "index names a tensor the shard lacks": (shard_index, r"extra\.safetensors: the index puts tensor "
                                                          r"'model\.norm\.weight' in this file, which does not hold it"),
    "corrupt tokenizer": (write("tokenizer.json", '{"model": '), r"tokenizer\.json: not a tokenizer file"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_checkpoint_is_a_checkpoint_error_naming_the_file_and_field(case, good, engine, tmp_path):
    """Loading the broken copy raises CheckpointError (nothing else) with the file and field in its
    message; the engine already loaded from the good checkpoint still gives its fresh tokens."""
    llm, fresh = engine
    broken = shutil.copytree(good, tmp_path / "broken")
    breaks, message = CASES[case]
    breaks(broken)
    with pytest.raises(CheckpointError, match=message):
        LLM(model=str(broken))
    assert [o.token_ids for o in llm.generate(PROBE, SamplingParams(max_tokens=6))] == fresh


@pytest.mark.parametrize("dtype", ["float64", ["bfloat16"]])
def test_a_dtype_the_engine_cannot_run_is_named(dtype, good, tmp_path):
    """The checkpoint's declared dtype (the GPU default) must be one the engine runs."""
    broken = shutil.copytree(good, tmp_path / "broken")
    edit_json("config.json", dtype=dtype)(broken)
    with pytest.raises(CheckpointError, match=r"config\.json: dtype is .*, not one of float32, bfloat16, float16"):
        checkpoint_dtype(broken)


def test_checkpoint_error_is_importable_from_the_package_and_is_a_value_error():
    assert minioverlap.CheckpointError is CheckpointError and issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("model", [None, 123, b"tiny", ["tiny"]])
def test_a_model_that_is_neither_a_name_nor_a_path_is_named(model, engine):
    """model= must be a shipped model's name or a directory: anything else is a CheckpointError that
    names the field and the value (not a TypeError from deep inside pathlib)."""
    llm, fresh = engine
    with pytest.raises(CheckpointError, match=r"model must be a shipped model's name \(tiny\) or a checkpoint "
                                              rf"directory, got {re.escape(repr(model))}"):
        LLM(model=model)
    assert [o.token_ids for o in llm.generate(PROBE, SamplingParams(max_tokens=6))] == fresh
