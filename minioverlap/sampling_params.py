"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16               # stop after this many new tokens (finish_reason "length")
    # >>> ch03: sampling
    temperature: float = 0.0           # 0: greedy; otherwise logits are divided by it before the softmax
    top_k: int = -1                    # keep only the k most likely tokens (-1: all)
    top_p: float = 1.0                 # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None            # a seeded request draws the same tokens whatever its batch
    # <<< ch03
    ignore_eos: bool = False           # keep going past an EOS token (for benchmarks)
    # >>> ch04: stop tokens
    stop_token_ids: tuple[int, ...] = ()   # more tokens that end the request (finish_reason "stop")
    # <<< ch04

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # >>> ch03: sampling
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all tokens) or an integer >= 1, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        # <<< ch03
        # >>> ch04: stop tokens
        self.stop_token_ids = tuple(self.stop_token_ids)
        # <<< ch04
