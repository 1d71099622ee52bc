# >>> ch15 file: the fast path's kernels
"""Triton kernels for the decode step (chapter 15), each beside the PyTorch code it replaces.

    kv_store.py      a step's K and V into the KV pool at their slots (KVPool.store)
    attention.py     paged attention over the page table, split over the context and merged with the
                     log-sum-exp rescale: a decode step (one query a request) and a verify window (k+1)
    elementwise.py   add + RMSNorm, q/k RMSNorm + RoPE, SiLU x up: each group one kernel

The PyTorch code stays the reference: every kernel is tested against it. On a machine without a CUDA
device the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any kernel is
defined), which runs each program in NumPy on CPU tensors: slow, but the same kernel, line for line.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
