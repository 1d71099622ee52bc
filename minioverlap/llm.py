"""The face of the engine: `LLM(...)` and `llm.generate(prompts, params)`.

In chapter 01 the engine serves one prompt at a time with a contiguous cache. The batching engine of
chapters 02-04 keeps these names; only what happens behind `generate` changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minioverlap.engine.contiguous import greedy_generate
from minioverlap.model.loader import DTYPES, checkpoint_dtype, load_model, load_tokenizer, resolve_model_dir
from minioverlap.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    uid: int                           # the request's id, in the order the prompts were given
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)   # the generated tokens (EOS included if hit)
    text: str = ""                     # the generated tokens decoded (special tokens skipped)
    finish_reason: str | None = None   # "stop" (EOS), "length" (max_tokens or the context limit)


class LLM:
    """Load a checkpoint and generate from prompts (text or token ids)."""

    def __init__(self, model: str = "tiny", device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_seq_len: int | None = None) -> None:
        self.model_dir = resolve_model_dir(model)
        self.device = _check_device(device)
        self.dtype = _resolve_dtype(dtype, self.device, self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        limit = self.config.max_position_embeddings
        if max_seq_len is not None and not (isinstance(max_seq_len, int) and 2 <= max_seq_len <= limit):
            raise ValueError(f"max_seq_len must be an integer in [2, {limit}] (the model's context), got {max_seq_len!r}")
        self.max_seq_len = max_seq_len or limit

    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> token ids, checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.model_dir} has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must hold at least 1 token")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_seq_len}, "
                             f"so a prompt may have at most {self.max_seq_len - 1}")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Greedy completions, one prompt after another. Every prompt is checked before any runs."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self.encode(p) for p in prompts]
        return [self._generate_one(uid, ids, params) for uid, ids in enumerate(encoded)]

    def _generate_one(self, uid: int, prompt: list[int], params: SamplingParams) -> RequestOutput:
        room = self.max_seq_len - len(prompt)           # the context limit is a stop rule too
        eos = () if params.ignore_eos else self.config.eos_token_ids
        tokens = greedy_generate(self.model, prompt, min(params.max_tokens, room), eos)
        reason = "stop" if tokens[-1] in eos else "length"
        return RequestOutput(uid, prompt, tokens, self.decode(tokens), reason)

    def shutdown(self) -> None:
        """Nothing to stop in chapter 01; the batching engine stops its loop here."""


def _check_device(device: str) -> str:
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU")
    return str(device)


def _resolve_dtype(dtype: str | torch.dtype | None, device: str, model_dir) -> torch.dtype:
    """None: fp32 on CPU (fast and exact there), the checkpoint's own dtype on a GPU."""
    if dtype is None:
        return torch.float32 if device == "cpu" else checkpoint_dtype(model_dir)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
