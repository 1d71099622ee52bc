# >>> ch02 file: the KV pool
"""The KV pool: per layer, one K and one V tensor of shape [num_slots, kv_heads, head_dim].

A token's keys and values live at one KV slot, the same slot in every layer. Which slot belongs to which
token of which request is not the pool's business: the req_to_token table says that.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K and V of this step's tokens [T, kv_heads, head_dim] at KV slots loc [T]."""
        self.k[layer_id][loc] = k
        self.v[layer_id][loc] = v
