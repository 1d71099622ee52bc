# >>> ch15 file: the attention context of the fast path
# >>> ch18 replaces ch15: a prefill's attention in a kernel of its own
#| """TritonAttention: PagedAttention (attention.py) with its decode steps and verify windows in the Triton
#| kernels of minioverlap/kernels, and every store of K and V in one kernel. A prefill's attention stays
#| PyTorch's (chapter 18 gives it a kernel of its own). The runner makes every context of this class once the
#| fast path is chosen at load (backend.py): nothing else asks which path it is on.
#| """
"""TritonAttention: PagedAttention (attention.py) with its decode steps, verify windows and prefills in the
Triton kernels of minioverlap/kernels (a prefill: one extend kernel a layer for the whole ragged batch, on a
GPU the one in FlashAttention-2's shape), and every store of K and V in one kernel. The runner makes every
context of this class once the fast path is chosen at load (backend.py): nothing else asks which path it
is on.
"""
# <<< ch18

from __future__ import annotations

import torch

from minioverlap.engine.attention import PagedAttention
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.kernels.attention import paged_attention
# >>> ch18: one extend kernel a layer
from minioverlap.kernels.extend_attention import extend_attention
from minioverlap.kernels.flash_extend import flash_extend_attention
# <<< ch18
from minioverlap.kernels.kv_store import store_kv


# >>> ch18 replaces ch15: a prefill's attention in one kernel
#| class TritonAttention(PagedAttention):
#|     def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
#|         if self.batch.mode is ForwardMode.EXTEND:
#|             return super().attend(layer_id, q, k, v)
#|         self.store(layer_id, k, v)
#|         return paged_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table, None,
#|                                self.batch.positions, window=len(q) // len(self.page_table))
#|
#|     def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
#|         store_kv(self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.batch.out_cache_loc, k, v)
class TritonAttention(PagedAttention):
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store(layer_id, k, v)
        if self.batch.mode is ForwardMode.EXTEND:
            ix = self.extend                    # one launch for the whole ragged prefill, its new K and V from k, v
            # the same function; the GPU's kernel tiles for its matrix units, the interpreter runs the chapter's
            extend = flash_extend_attention if q.is_cuda else extend_attention
            return extend(q, k, v, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], ix.qo_indptr, ix.kv_indptr,
                          ix.kv_indices, ix.max_extend)
        return paged_attention(q, self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_table, None,
                               self.batch.positions, window=len(q) // len(self.page_table))

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.batch.out_cache_loc, k, v)
# <<< ch18
