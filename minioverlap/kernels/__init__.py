# >>> ch15 file: the fast path's kernels
"""Triton kernels for the decode step (chapter 15), each beside the PyTorch code it replaces.

    kv_store.py      a step's K and V into the KV pool at their slots (PagedAttention.store)
    attention.py     paged attention over the page table, split over the context and merged with the
                     log-sum-exp rescale: a decode step (one query a request) and a verify window (k+1)
    elementwise.py   add + RMSNorm, q/k RMSNorm + RoPE, SiLU x up: each group one kernel

The PyTorch code stays the reference: every kernel is tested against it. On a machine without a CUDA
device the kernels run in Triton's interpreter (TRITON_INTERPRET=1), which runs each program in NumPy
on CPU tensors: slow, but the same kernel, line for line. Triton reads the variable as it defines each
function, its own library's too (tl.sum, ...), when triton is first imported, and PyTorch imports it
on its own (torch._dynamo does, when a model is built): so minioverlap/__init__.py imports this module
first of all. This module imports no triton itself: without it installed, the reference path runs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
