# >>> ch02 file: the KV pool
"""The KV pool: per layer, one K and one V tensor of shape [num_slots, kv_heads, head_dim].

A token's keys and values live at one KV slot, the same slot in every layer. Which slot belongs to which
token of which request is not the pool's business: the req_to_token table says that. How large the
pool may be (the pages a default pool holds, the device's memory) is worked out here too.
"""

from __future__ import annotations

import os

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


def default_pages(max_running: int, max_seq_len: int, page_size: int) -> int:
    """Pages for every request slot to hold a whole row of max_seq_len tokens at once (page 0 is never
    handed out)."""
    return max_running * -(-max_seq_len // page_size) + 1
# >>> ch21: the pool sized by what is given


def pool_pages(default: int, page_size: int, page_bytes: int, num_pages: int | None = None,
               max_total_tokens: int | None = None, pool_bytes: int | None = None) -> int:
    """The pool's pages, page 0 included: num_pages as given; else room for max_total_tokens tokens; else
    as many as pool_bytes (what mem_fraction_static leaves, static_budget) holds, but no more than
    `default`; else `default`, every request slot's whole context (default_pages)."""
    if num_pages is not None:
        return num_pages
    if max_total_tokens is not None:
        return -(-max_total_tokens // page_size) + 1
    if pool_bytes is not None:
        return min(pool_bytes // page_bytes, default)
    return default


def static_budget(fraction: float, device: str, in_use: int) -> int:
    """Bytes for the KV pool when the weights and the pool may take `fraction` of the device's memory:
    that share of all of it, less `in_use` (what stays in use beside the pool: the weights; on a GPU also
    the CUDA context, other processes and the largest step's activations)."""
    return int(fraction * total_memory(device)) - in_use


def check_tables(max_running: int, max_seq_len: int, device: str) -> None:
    """Refuse request tables larger than the device's memory before the memory in use is measured with a
    step of max_running requests (Engine.memory_in_use), which would fail first with a MemoryError that
    names no argument; check_memory refuses them too, but only once the pool is sized."""
    tables = table_bytes(max_running, max_seq_len)
    have, where = device_memory(device)
    if tables > have:
        raise ValueError(f"max_running={max_running} need {gib(tables)}, more than {where} ({gib(have)}): the request "
                         f"tables 2 x (max_running + 1) x max_seq_len x 4 bytes = {gib(tables)}")


def total_memory(device: str) -> int:
    """All of the device's memory: a GPU's, or this machine's physical memory (device_memory)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[1]
    return device_memory(device)[0]


def check_holds_a_context(num_pages: int, page_size: int, max_seq_len: int, sized_by: str, option: str) -> None:
    """A pool sized by max_total_tokens or the memory must hold one request of max_seq_len tokens, or a
    request of that size would be refused as too large for the pool (check_fits_pool)."""
    need = default_pages(1, max_seq_len, page_size)
    if num_pages < need:
        raise ValueError(f"{sized_by} gives a KV pool of {max(num_pages - 1, 0) * page_size} tokens, less than one "
                         f"context of max_seq_len={max_seq_len} tokens ({need} pages of {page_size}, page 0 "
                         f"included): pass a larger {option} or a smaller max_seq_len")
# <<< ch21


def check_memory(num_pages: int, page_size: int, slot_bytes: int, max_running: int, max_seq_len: int,
                 device: str) -> None:
    """Refuse a KV pool (slot_bytes a token, all layers) and request tables larger than the device's
    memory, before torch tries to allocate them (and fails with a MemoryError or an OverflowError that
    names no argument)."""
    kv = num_pages * page_size * slot_bytes
    tables = table_bytes(max_running, max_seq_len)
    have, where = device_memory(device)
    if kv + tables > have:
        raise ValueError(f"num_pages={num_pages}, page_size={page_size} and max_running={max_running} need "
                         f"{gib(kv + tables)}, more than {where} ({gib(have)}): the KV pool is num_pages x page_size "
                         f"x {slot_bytes} bytes = {gib(kv)}, the request tables 2 x (max_running + 1) x max_seq_len "
                         f"x 4 bytes = {gib(tables)}")


def table_bytes(max_running: int, max_seq_len: int) -> int:
    """The request tables req_to_token and token_pool: int32, max_running + 1 rows of max_seq_len each."""
    return 2 * (max_running + 1) * max_seq_len * 4


def device_memory(device: str) -> tuple[int, str]:
    """Bytes the pool and tables may take: on a GPU what is free (the weights are there already), on CPU
    the machine's physical memory."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0], f"the free memory of {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's physical memory"


def gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"
