"""Chapter 05: the CPU's view and the device's view of one request, step by step.

The sampler writes each new token into token_pool on the device; the next step reads it there. So
the CPU can launch step N+1 before it has step N's token: here it does exactly that, and prints what
each side knows right after each launch.

    python examples/ch05_token_on_gpu.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams
from minioverlap.config import EngineArgs

llm = LLM(model="tiny")
sched = llm.scheduler
[req] = llm.make_requests(["def fibonacci(n):"], SamplingParams(max_tokens=6, ignore_eos=True))
sched.add_request(req)
sched.receive()
P = len(req.prompt_ids)
print(f"prompt: {P} tokens. After each launch: the CPU's count of launched tokens and the tokens it has")
print("received, and what token_pool holds on the device past the prompt.\n")
print(f"{'launched':>8}  {'CPU: seq_len':>12}  {'CPU: received':<34}  device: token_pool[row, {P}:]")
last = None
for _ in range(6):
    out = sched.launch(sched.schedule())
    device = llm.runner.tables.token_pool[req.row, P:req.seq_len + 1].tolist()
    print(f"{'step ' + str(out.step):>8}  {req.seq_len:>12}  {str(req.output_ids):<34}  {device}")
    if last is not None:                       # handle step N only after step N+1 is launched
        sched.wait(last)
        sched.process(last)
    last = out
sched.wait(last)
sched.process(last)
print(f"\nreceived at the end: {req.output_ids}")
# From chapter 06 on LLM has a second loop, the default from chapter 07: compare with the normal one.
normal = LLM(model="tiny", **({"overlap": False} if "overlap" in EngineArgs.__dataclass_fields__ else {}))
same = req.output_ids == normal.generate(["def fibonacci(n):"], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
print(f"equal to the normal loop: {same}")
