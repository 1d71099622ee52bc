"""Chapter 17: two requests that share a prefix. The second one's prefill starts where the cached prefix
ends: it computes only its own question, and the trace shows the hit.

    python examples/ch17_prefix_cache.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams
from minioverlap.engine.forward_batch import ForwardMode

SYSTEM = ("You are a careful Python tutor. Answer with one short function, a docstring that says what it "
          "returns, and no other text.\n")
QUESTIONS = ["Q: the n-th Fibonacci number\nA: def fib(n):", "Q: is a string a palindrome\nA: def is_pal(s):"]
params = SamplingParams(max_tokens=16)

llm = LLM(model="tiny", page_size=4)
prefills = []                                   # each prefill step's requests and new tokens
batch = llm.runner.batch
llm.runner.batch = lambda mode, reqs: (prefills.append([(r.uid, len(r.prompt_ids) - r.seq_len) for r in reqs])
                                       if mode is ForwardMode.EXTEND else None) or batch(mode, reqs)

outs = [llm.generate(SYSTEM + q, params)[0] for q in QUESTIONS]       # one after the other: the first is cached
for out, [(uid, computed)] in zip(outs, prefills):
    print(f"request {uid}: prompt {len(out.prompt_token_ids)} tokens, {out.cached_tokens} from the cache, "
          f"prefill computes {computed}")
print()
print("the second run's trace:")
for event in llm.trace[:6]:
    print(f"  step {event.step}  {event.kind:8} {list(event.uids)}")
print()
off = LLM(model="tiny", page_size=4, prefix_cache=False)
same = [o.token_ids == off.generate(SYSTEM + q, params)[0].token_ids for o, q in zip(outs, QUESTIONS)]
print(f"tokens equal to the engine without the cache: {all(same)}")
llm.check_integrity()
tree = llm.runner.cache.tree
print(f"integrity holds; the tree keeps {tree.cached_pages} pages, {tree.evictable_pages} of them evictable "
      f"(no request runs), {llm.runner.allocator.num_free} pages free")
