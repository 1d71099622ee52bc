"""Chapter 18 (so far): a prefill step's attention is one call for all its requests. The example prefills
one prompt, then five (the first of them now a prefix hit: 8 of its 9 tokens cached), and prints each step's ragged layout and the operators its attention runs in a
layer: the same for one request as for five. Then the fast path (its extend kernel, in Triton's
interpreter without a GPU) gives the same tokens.

    python examples/ch18_extend_attention.py
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from minioverlap import LLM, SamplingParams
from minioverlap.engine.attention import PagedAttention

PROMPTS = ["def fibonacci(n):", "a", "class Stack:\n    def __init__(self):", "import os\n", "x = [1, 2, 3]"]
params = SamplingParams(max_tokens=8)


class CountOps(TorchDispatchMode):
    """The aten operators called under it: on a GPU, each one a kernel launch (or none, a view)."""
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


extend = PagedAttention.extend_attention
seen = []                                       # each prefill layer's (requests, ragged layout, operators)


def counted(self, layer_id, q):
    with CountOps() as count:
        out = extend(self, layer_id, q)
    seen.append((len(self.batch.reqs), self.extend, count.ops))
    return out


PagedAttention.extend_attention = counted
llm = LLM(model="tiny", page_size=4, kernels=False)
for prompts in (PROMPTS[:1], PROMPTS):
    seen.clear()
    want = [o.token_ids for o in llm.generate(prompts, params)]
    reqs, ix, ops = seen[-1]
    print(f"{reqs} request(s): qo_indptr {ix.qo_indptr.tolist()}, kv_indptr {ix.kv_indptr.tolist()}")
    layers = llm.model.config.num_hidden_layers
    print(f"  {len(seen)} attention calls for {layers} layers; the last layer's: {ops} operators")
PagedAttention.extend_attention = extend

fast = LLM(model="tiny", page_size=4, kernels=True)
got = [o.token_ids for o in fast.generate(PROMPTS, params)]
print(f"the fast path (one extend kernel a layer) gives the same tokens: {got == want}")
