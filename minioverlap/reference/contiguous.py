"""Chapter 01: greedy generation for one prompt with a contiguous KV cache.

The simplest cache there is: per layer, one K and one V tensor of shape [max_len, kv_heads, head_dim],
filled from position 0. Prefill writes the whole prompt at once; each decode step writes one token and
attends over everything before it. It serves one request at a time and reserves max_len slots for it,
whatever its real length: chapter 02 replaces it with a paged cache that many requests share.
"""

from __future__ import annotations

import torch

from minioverlap.engine.request import Req
from minioverlap.model.qwen3 import Qwen3ForCausalLM, attention


class ContiguousCache:
    """K and V of one sequence, one tensor pair per layer; `length` tokens are filled."""

    def __init__(self, model: Qwen3ForCausalLM, max_len: int) -> None:
        c = model.config
        weight = model.model.embed_tokens.weight
        shape = (c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.length = 0

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k and v after the cached ones, then attend over all of them."""
        start, end = self.length, self.length + q.shape[0]
        self.k[layer_id, start:end] = k
        self.v[layer_id, start:end] = v
        return attention(q, self.k[layer_id, :end], self.v[layer_id, :end], q_start=start)


@torch.inference_mode()
def greedy_generate(model: Qwen3ForCausalLM, prompt: list[int], max_tokens: int,
                    eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt, then decode one token at a time, always taking the most likely one."""
    device = model.model.embed_tokens.weight.device
    cache = ContiguousCache(model, len(prompt) + max_tokens)
    input_ids = torch.tensor(prompt, device=device)
    out: list[int] = []
    while len(out) < max_tokens:
        positions = torch.arange(cache.length, cache.length + len(input_ids), device=device)
        hidden = model(input_ids, positions, cache)
        cache.length += len(input_ids)
        token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        out.append(token)
        if token in eos_token_ids:
            break
        input_ids = torch.tensor([token], device=device)
    return out


def serve(llm, reqs: list[Req]) -> None:
    """LLM.generate's path in chapter 01: each request in turn, to its end."""
    for req in reqs:
        req.output_ids = greedy_generate(llm.model, req.prompt_ids, req.max_new_tokens, tuple(req.stop_ids))
        req.finish_reason = req.check_stop()
