"""Chapter 19 (so far): a completion constrained by a JSON schema, one by a regex, and one free, in one
batch of the normal loop. The tiny model writes Python, not JSON; the grammar's mask leaves it only the
tokens that keep its output valid, so its greedy output parses, and ends where the JSON ends.

    python examples/ch19_waits_left.py
"""

from __future__ import annotations

import json

from minioverlap import LLM, SamplingParams

SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}

llm = LLM(overlap=False)                 # the normal loop: the overlap loop's mask wait comes later
prompts = ["def fibonacci(n):", "def fibonacci(n):", "def fibonacci(n):"]
params = [SamplingParams(max_tokens=48, json_schema=SCHEMA),
          SamplingParams(max_tokens=48, regex=r"\d{3}-\d{4}"),
          SamplingParams(max_tokens=12)]
outs = llm.generate(prompts, params)
for label, out in zip(["json_schema", "regex", "free"], outs):
    print(f"{label:<12} {out.finish_reason:<7} {out.text!r}")
print("json.loads:", json.loads(outs[0].text))
llm.check_integrity()
