# >>> ch15 file: the KV store kernel
"""Store a step's K and V into the KV pool: one program per token, both tensors in one launch.

The reference is two index assignments (`k_pool[loc] = k; v_pool[loc] = v`), which PyTorch runs as
two scatter kernels. Here a program reads its token's KV slot from `loc` and copies the token's
kv_heads x head_dim values of K and of V to that slot. Nothing in the row is strided but the token:
a slot's values lie next to each other in the pool ([num_slots, kv_heads, head_dim], contiguous),
and so do a token's in k and v (which may be views into a wider tensor, one row per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(k, v, k_pool, v_pool, loc, stride_k, stride_v, N: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    # >>> exercise 15.1: the KV store kernel
    slot = tl.load(loc + token).to(tl.int64)             # int64: slot x N overflows int32 in a large pool
    i = tl.arange(0, BLOCK)
    inside = i < N
    tl.store(k_pool + slot * N + i, tl.load(k + token * stride_k + i, mask=inside), mask=inside)
    tl.store(v_pool + slot * N + i, tl.load(v + token * stride_v + i, mask=inside), mask=inside)
    # <<< exercise 15.1


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k and v [T, kv_heads, head_dim] (each token's row contiguous) into the pools at KV slots loc [T]."""
    T, H, D = k.shape
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape[1:] == (H, D)
    assert k.stride()[1:] == v.stride()[1:] == (D, 1), "each token's K and V lie together"
    loc = loc.contiguous()          # the kernel reads loc[token] at loc + token: a strided view (MTP's draft rows) is copied
    if T:
        store_kv_kernel[(T,)](k, v, k_pool, v_pool, loc, k.stride(0), v.stride(0), N=H * D,
                              BLOCK=triton.next_power_of_2(H * D))
