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
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from minioverlap.model.qwen3 import Qwen3Config, Qwen3ForCausalLM

SHIPPED = {"tiny": Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as the Qwen3 model its config describes."""


def resolve_model_dir(model: str | Path) -> Path:
    """A shipped model's name ("tiny") or a path -> the checkpoint directory."""
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
    raw = json.loads(path.read_text())
    if raw.get("model_type") != "qwen3":
        raise CheckpointError(f"{path}: model_type is {raw.get('model_type')!r}, expected 'qwen3'")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    unsupported = {
        "rope type": (rope.get("rope_type", rope.get("type", "default")), "default"),
        "hidden_act": (raw.get("hidden_act", "silu"), "silu"),
        "attention_bias": (raw.get("attention_bias", False), False),
        "use_sliding_window": (raw.get("use_sliding_window", False), False),
    }
    for field, (value, supported) in unsupported.items():
        if value != supported:
            raise CheckpointError(f"{path}: {field} is {value!r}; this engine supports only {supported!r}")
    heads = raw["num_attention_heads"]
    return Qwen3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        eos_token_ids=_eos_token_ids(model_dir, raw),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0),
    )


def _eos_token_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [raw]
    if (model_dir / "generation_config.json").is_file():
        sources.append(json.loads((model_dir / "generation_config.json").read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in [eos] if isinstance(eos, int) else (eos or []):
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype config.json declares (dtype, or torch_dtype in older files); fp32 if none."""
    raw = json.loads((model_dir / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return DTYPES[name]


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors and no model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def is_mtp_tensor(name: str, config: Qwen3Config) -> bool:
    """MTP layers are stored as model.layers.{L}.* with L >= num_hidden_layers (DeepSeek-V3 naming)."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and config.num_hidden_layers <= int(parts[2]) < config.num_hidden_layers + config.num_nextn_predict_layers)


def read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors, opening each shard once."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted({files[n] for n in names}):
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the index but missing")
        with safe_open(path, "pt") as f:
            for name in names:
                if files[name] == path:
                    tensors[name] = f.get_tensor(name)
    return tensors


def load_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> Qwen3ForCausalLM:
    """Build the model from config.json and fill every parameter from the safetensors files."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    files = weight_files(model_dir)
    for name, path in files.items():
        if name not in expected and not is_mtp_tensor(name, config) and not (name == "lm_head.weight" and config.tie_word_embeddings):
            raise CheckpointError(f"{path}: unexpected tensor {name!r}; config.json describes no such weight")
    missing = [name for name in expected if name not in files]
    if missing:
        raise CheckpointError(f"{model_dir}: tensor {missing[0]!r} with shape {list(expected[missing[0]])} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if config.tie_word_embeddings and "lm_head.weight" in files:     # some exporters write the tied head anyway
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    tensors = read_tensors(files, list(expected))
    if "lm_head.weight" in tensors and config.tie_word_embeddings:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
            raise CheckpointError(f"{files['lm_head.weight']}: config.json ties the head to the embedding, "
                                  "but tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'")
        del expected["lm_head.weight"]
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{files[name]}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")
    state = {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """tokenizer.json if the checkpoint has one; without it, prompts must be token ids."""
    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None
