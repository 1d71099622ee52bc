# >>> ch15 file: the path a step takes, chosen once at load
"""The reference path or the fast path, chosen once when the engine is built: the model's class, the MTP
layer's and the attention context's. Nothing past the load asks which it is: the runner makes its
attention contexts of the chosen class, and the model's forward is the chosen class's own.

The fast path's modules import Triton, so they are imported only when it is chosen: without Triton
installed (a machine other than Linux) the reference path still runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from minioverlap.engine.attention import PagedAttention
from minioverlap.model.mtp import MTPLayer
from minioverlap.model.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class Backend:
    kernels: bool                               # the fast path: Triton and fused kernels (chapter 15)
    model: type[Qwen3ForCausalLM]
    mtp: type[MTPLayer]
    attention: type[PagedAttention]


def backend(kernels: bool) -> Backend:
    if not kernels:
        return Backend(False, Qwen3ForCausalLM, MTPLayer, PagedAttention)
    from minioverlap.engine.triton_attention import TritonAttention
    from minioverlap.model.fused import FusedMTPLayer, FusedQwen3ForCausalLM
    return Backend(True, FusedQwen3ForCausalLM, FusedMTPLayer, TritonAttention)
