"""Chapter 06: the normal loop and the overlap loop, side by side.

    python examples/ch06_overlap_loop.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams

llm = {loop: LLM(model="tiny", overlap=loop == "overlap") for loop in ("normal", "overlap")}

print("one request, three tokens:")
for loop, engine in llm.items():
    engine.generate(["def fibonacci(n):"], SamplingParams(max_tokens=3, ignore_eos=True))
    print(f"  {loop + ':':9}" + ", ".join(engine.trace.order()))

prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"] * 4
params = SamplingParams(max_tokens=32, ignore_eos=True)
outputs = {loop: [o.token_ids for o in engine.generate(prompts, params)] for loop, engine in llm.items()}
print(f"\n{len(prompts)} requests of {params.max_tokens} tokens: same tokens in both loops: "
      f"{outputs['normal'] == outputs['overlap']}")
for loop, engine in llm.items():
    phases = engine.trace.phase_times_us()
    print(f"  {loop:8} host time per step: " + ", ".join(f"{k} {v:.0f} us" for k, v in phases.items()))
print("\nOn a CPU the device is the host's own cores: 'launch' runs the step, so nothing overlaps. On a")
print("GPU, launch only queues the step, and the overlap loop handles step N while step N+1 runs.")
