"""Chapter 19: the waits overlap cannot remove. A request constrained by a JSON schema, run in the normal loop
and in the overlap loop: the same valid JSON from both, and in the overlap loop's trace each step's `mask`
(its masks filled, its sample queued) comes only after the step before it is handled, while its forward
was launched before. Then the n-gram drafter on a prompt that repeats itself: the same tokens as plain
decoding in fewer target passes, and an overlap loop that launches no step before the last one is handled.

    python examples/ch19_waits_left.py
"""

from __future__ import annotations

import json

from minioverlap import LLM, SamplingParams

SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}}}
REPEATS = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n"


def show(llm: LLM) -> None:
    """The trace's events from step 2's schedule to step 4's, in the order they happened."""
    events = [(e.kind, e.step) for e in llm.trace]
    events = events[events.index(("schedule", 2)):events.index(("schedule", 4))]
    print("   ", ", ".join(f"{kind} {step}" for kind, step in events))


print("A JSON schema, both loops (the first steps' events; a mask marks a put-off sample):")
texts = []
for overlap in (False, True):
    llm = LLM(overlap=overlap)
    [out] = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=48, json_schema=SCHEMA))
    texts.append(out.text)
    print(f"  {'overlap' if overlap else 'normal '} loop: {out.text!r} ({out.finish_reason})")
    show(llm)
print("  the same text:", texts[0] == texts[1], "| json.loads:", json.loads(texts[1]))

print("\nThe n-gram drafter (3 drafts a step) on a prompt that repeats itself:")
plain = LLM(overlap=True).generate(REPEATS, SamplingParams(max_tokens=32, ignore_eos=True))[0]
for overlap in (False, True):
    llm = LLM(overlap=overlap, ngram_steps=3)
    [out] = llm.generate(REPEATS, SamplingParams(max_tokens=32, ignore_eos=True))
    print(f"  {'overlap' if overlap else 'normal '} loop: {len(out.token_ids)} tokens in {out.verify_steps} target "
          f"passes, accept length {len(out.token_ids) / out.verify_steps:.2f}, "
          f"the plain tokens: {out.token_ids == plain.token_ids}")
    show(llm)
    llm.check_integrity()
