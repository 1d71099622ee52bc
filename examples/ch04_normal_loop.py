"""Chapter 04: the normal loop's events, in order, and where a step's CPU time goes.

    python examples/ch04_normal_loop.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams
from minioverlap.config import EngineArgs

# From chapter 06 on LLM has a second loop, the default from chapter 07: ask for this chapter's by name;
# and from chapter 18 a budget of prompt tokens per step: ask for whole prompts.
normal = {"overlap": False} if "overlap" in EngineArgs.__dataclass_fields__ else {}
normal |= {"chunked_prefill_size": -1} if "chunked_prefill_size" in EngineArgs.__dataclass_fields__ else {}
llm = LLM(model="tiny", **normal)
llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=3, ignore_eos=True))
print("one request, three tokens:")
print("  " + ", ".join(llm.trace.order()))

prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"] * 4
llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
print(f"\n16 requests, 32 tokens each: {len({e.step for e in llm.trace})} steps; mean host time per phase:")
for kind, us in llm.trace.phase_times_us().items():
    print(f"  {kind:9s} {us:8.0f} us")
