"""Chapter 03: many prompts in one batch, each equal to its solo run; seeded sampling per request.

    python examples/ch03_batching.py
"""

from __future__ import annotations

import time

from minioverlap import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):", "x = [1, 2, 3]\nprint("]
params = SamplingParams(max_tokens=32)
llm = LLM(model="tiny")

start = time.perf_counter()
together = llm.generate(PROMPTS, params)
batched = time.perf_counter() - start
start = time.perf_counter()
alone = [llm.generate([p], params)[0] for p in PROMPTS]
solo = time.perf_counter() - start
for prompt, a, b in zip(PROMPTS, together, alone):
    print(f"{prompt!r:28} {len(a.prompt_token_ids):2d} prompt tokens -> equal to its solo run: {a.token_ids == b.token_ids}")
print(f"{len(PROMPTS)} prompts: {batched:.2f} s in one batch, {solo:.2f} s one after another")

seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=42)
mine = llm.generate(["def parse(line):"], seeded)[0]
crowd = llm.generate(["import re\n", "def parse(line):", "class Node:"],
                     [SamplingParams(max_tokens=16, temperature=1.0), seeded, SamplingParams(max_tokens=16)])[1]
print(f"seeded sample alone:    {mine.text!r}")
print(f"seeded sample in batch: {crowd.text!r}  same tokens: {mine.token_ids == crowd.token_ids}")
