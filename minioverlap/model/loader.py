"""Loading a Qwen3 checkpoint from a local HF-format directory.

A checkpoint directory holds config.json, the weights as one model.safetensors or as shards listed in
model.safetensors.index.json, and usually tokenizer.json. The loader reads the config into
`Qwen3Config`, builds the model on the meta device (no memory, no random init), then assigns every
tensor by name, checking each name and shape against what the config implies. Anything that does not
fit is an error naming the file, the tensor and the expected shape: a checkpoint that loads "mostly"
would produce wrong tokens with no warning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
# >>> ch20: read_tensors' reader
from collections.abc import Callable
from typing import Any
# <<< ch20
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from minioverlap.model.qwen3 import Qwen3Config, Qwen3ForCausalLM

SHIPPED = {"tiny": Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as the Qwen3 model its config describes."""


# The kinds of config.json field the loader reads, each with the test a value of that kind passes
# (`type(v) is int` keeps out JSON's true and false).
KINDS = {
    "an integer >= 0": lambda v: type(v) is int and v >= 0,
    "an integer >= 1": lambda v: type(v) is int and v >= 1,
    "an integer >= 2 (a prompt token and one new token)": lambda v: type(v) is int and v >= 2,
    "a finite number > 0": lambda v: type(v) in (int, float) and 0 < v < float("inf"),
    "true or false": lambda v: type(v) is bool,
}


def resolve_model_dir(model: str | Path) -> Path:
    """A shipped model's name ("tiny") or a path -> the checkpoint directory."""
    if not isinstance(model, (str, os.PathLike)):
        raise CheckpointError(f"model must be a shipped model's name ({', '.join(SHIPPED)}) or a checkpoint "
                              f"directory, got {model!r}")
    if str(model) in SHIPPED:
        return SHIPPED[str(model)]
    path = Path(model)
    if not path.is_dir():
        raise CheckpointError(f"model={str(model)!r}: not a shipped model ({', '.join(SHIPPED)}) and not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model={str(model)!r}: the directory has no config.json")
    return path


def load_config(model_dir: Path) -> Qwen3Config:
    """config.json (transformers 4.x or 5.x naming) -> Qwen3Config, refusing what this model lacks."""
    path = model_dir / "config.json"
    raw = read_json(path)
    if raw.get("model_type") != "qwen3":
        raise CheckpointError(f"{path}: model_type is {raw.get('model_type')!r}, expected 'qwen3'")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{path}: rope_parameters must be a JSON object, got {rope!r}")
    unsupported = {
        "rope type": (rope.get("rope_type", rope.get("type", "default")), "default"),
        "hidden_act": (raw.get("hidden_act", "silu"), "silu"),
        "attention_bias": (raw.get("attention_bias", False), False),
        "use_sliding_window": (raw.get("use_sliding_window", False), False),
    }
    for field, (value, supported) in unsupported.items():
        if value != supported:
            raise CheckpointError(f"{path}: {field} is {value!r}; this engine supports only {supported!r}")
    field = partial(config_field, path, raw)          # field(name, kind, default): one checked field
    heads, hidden = field("num_attention_heads", "an integer >= 1"), field("hidden_size", "an integer >= 1")
    kv_heads = field("num_key_value_heads", "an integer >= 1", heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    return Qwen3Config(
        vocab_size=field("vocab_size", "an integer >= 1"),
        hidden_size=hidden,
        intermediate_size=field("intermediate_size", "an integer >= 1"),
        num_hidden_layers=field("num_hidden_layers", "an integer >= 1"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=field("head_dim", "an integer >= 1", hidden // heads),
        rms_norm_eps=field("rms_norm_eps", "a finite number > 0", 1e-6),
        rope_theta=config_field(path, rope if "rope_theta" in rope else raw, "rope_theta", "a finite number > 0", 10000.0),
        max_position_embeddings=field("max_position_embeddings", "an integer >= 2 (a prompt token and one new token)", 32768),
        tie_word_embeddings=field("tie_word_embeddings", "true or false", False),
        eos_token_ids=_eos_token_ids(model_dir, raw),
        num_nextn_predict_layers=field("num_nextn_predict_layers", "an integer >= 0", 0),
    )


def config_field(path: Path, raw: dict, name: str, kind: str, default: object = None) -> object:
    """raw[name] if it is of `kind` (a key of KINDS); a field that is absent or null takes the default,
    and one without a default is required."""
    value = raw.get(name)
    if value is None and default is None:
        raise CheckpointError(f"{path}: required field {name!r} is missing (or null)")
    if value is None:
        return default
    if not KINDS[kind](value):
        raise CheckpointError(f"{path}: {name} must be {kind}, got {value!r}")
    return value


def read_json(path: Path) -> dict:
    """A JSON file that must hold an object; anything else is a CheckpointError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:             # ValueError: not UTF-8, or not JSON
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(raw).__name__} {raw!r:.60}")
    return raw


def _eos_token_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [(model_dir / "config.json", raw)]
    if (model_dir / "generation_config.json").is_file():
        sources.append((model_dir / "generation_config.json", read_json(model_dir / "generation_config.json")))
    for path, source in sources:
        eos = source.get("eos_token_id")
        tokens = [] if eos is None else [eos] if type(eos) is int else eos
        if not (isinstance(tokens, list) and all(KINDS["an integer >= 0"](t) for t in tokens)):
            raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of token ids, got {eos!r}")
        for token in tokens:
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype config.json declares (dtype, or torch_dtype in older files); fp32 if none."""
    path = model_dir / "config.json"
    raw = read_json(path)
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if not (isinstance(name, str) and name in DTYPES):
        raise CheckpointError(f"{path}: dtype is {name!r}, not one of {', '.join(DTYPES)}; pass dtype= to choose one")
    return DTYPES[name]


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(file, str) for file in weight_map.values())):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names, got {weight_map!r:.60}")
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors and no model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


@contextmanager
def open_safetensors(path: Path) -> Iterator:
    """safe_open, where a file that is not safetensors (empty, truncated, a garbage header) or a tensor
    that cannot be read is a CheckpointError naming the file."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def is_mtp_tensor(name: str, config: Qwen3Config) -> bool:
    """MTP layers are stored as model.layers.{L}.* with L >= num_hidden_layers (DeepSeek-V3 naming)."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and config.num_hidden_layers <= int(parts[2]) < config.num_hidden_layers + config.num_nextn_predict_layers)


def check_shapes(files: dict[str, Path], expected: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor has the shape the config implies."""
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{files[name]}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")


def read_tensors(files: dict[str, Path], names: list[str],
                 # >>> ch20: how one tensor is read (a tensor-parallel rank reads only its slice)
                 read: Callable[[Any, str], torch.Tensor] = lambda f, name: f.get_tensor(name),
                 # <<< ch20
                 ) -> dict[str, torch.Tensor]:
    """Read the named tensors, opening each shard once."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted({files[n] for n in names}):
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the index but missing")
        with open_safetensors(path) as f:
            held = set(f.keys())
            for name in (n for n in names if files[n] == path):
                if name not in held:
                    raise CheckpointError(f"{path}: the index puts tensor {name!r} in this file, which does not hold it")
                # >>> ch20 replaces ch01: through `read`
                #| tensors[name] = f.get_tensor(name)
                tensors[name] = read(f, name)
                # <<< ch20
    return tensors


def checkpoint_tensors(model_dir: Path, config: Qwen3Config, model: Qwen3ForCausalLM) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """The checkpoint's files by tensor name, and the tensors to read with their full shapes: the model's
    (a model of the checkpoint's shapes), checked by name against the files; a tied head is read only
    if the file holds it anyway, to check that it is the embedding."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    files = weight_files(model_dir)
    check_names(model_dir, config, files, expected)
    if config.tie_word_embeddings and "lm_head.weight" in files:     # some exporters write the tied head anyway
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    return files, expected


def check_names(model_dir: Path, config: Qwen3Config, files: dict[str, Path], expected: dict[str, tuple[int, ...]]) -> None:
    """No tensor the config does not describe (the MTP layer's are known), none it implies missing."""
    for name, path in files.items():
        if name not in expected and not is_mtp_tensor(name, config) and not (name == "lm_head.weight" and config.tie_word_embeddings):
            raise CheckpointError(f"{path}: unexpected tensor {name!r}; config.json describes no such weight")
    missing = [name for name in expected if name not in files]
    if missing:
        raise CheckpointError(f"{model_dir}: tensor {missing[0]!r} with shape {list(expected[missing[0]])} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def load_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device,
               # >>> ch15: the model's class, chosen once at load (the fast path's, or the reference)
               model_class: type[Qwen3ForCausalLM] = Qwen3ForCausalLM,
               # <<< ch15
               ) -> Qwen3ForCausalLM:
    """Build the model from config.json and fill every parameter from the safetensors files."""
    config = load_config(model_dir)
    # >>> ch15 replaces ch01: of the class chosen at load
    #| with torch.device("meta"):
    #|     model = Qwen3ForCausalLM(config)
    with torch.device("meta"):
        model = model_class(config)
    # <<< ch15
    files, expected = checkpoint_tensors(model_dir, config, model)
    tensors = read_tensors(files, list(expected))
    if "lm_head.weight" in tensors and config.tie_word_embeddings:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
            raise CheckpointError(f"{files['lm_head.weight']}: config.json ties the head to the embedding, "
                                  "but tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'")
        del expected["lm_head.weight"]
    check_shapes(files, expected, tensors)
    state = {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """tokenizer.json if the checkpoint has one; without it, prompts must be token ids."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                     # tokenizers raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"{path}: not a tokenizer file that tokenizers can read ({e})") from e
