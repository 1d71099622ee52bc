"""Chapter 05: the sampled token stays on the device; the next step is launched without it."""

from __future__ import annotations

import torch

from minioverlap import LLM, SamplingParams


def test_step_n_plus_1_launches_before_the_host_has_token_n():
    """Launch step N+1 before handling step N: the host holds none of step N's tokens at that launch,
    yet every token equals the normal loop's. So launching never reads a token value on the host."""
    llm = LLM(model="tiny")
    prompts = ["def fibonacci(n):", "class Stack:", "import os\n"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids[:6] for o in llm.generate(prompts, params)]
    sched = llm.scheduler
    reqs = llm.make_requests(prompts, params)
    for req in reqs:
        sched.add_request(req)
    sched.receive()
    last = sched.launch(sched.schedule())                    # step 1: the prefill
    for _ in range(5):
        received = [len(r.output_ids) for r in reqs]
        out = sched.launch(sched.schedule())                  # step N+1 ...
        assert [len(r.output_ids) for r in reqs] == received, "... launched with no new token on the host"
        sched.wait(last)
        sched.process(last)                                   # ... and only then step N's tokens arrive
        last = out
    sched.wait(last)
    sched.process(last)
    assert [r.output_ids for r in reqs] == expected
    llm.check_integrity()


def test_the_sampler_writes_the_next_input_into_token_pool():
    """Right after launch, token_pool[row, seq_len] holds the sampled token, on the device, and the
    request's seq_len has already advanced (the CPU's state moves at launch); the next step reads it."""
    llm = LLM(model="tiny")
    sched = llm.scheduler
    [req] = llm.make_requests(["def f(x):"], SamplingParams(max_tokens=4))
    sched.add_request(req)
    sched.receive()
    out = sched.launch(sched.schedule())
    assert req.seq_len == len(req.prompt_ids) and req.output_ids == []
    pool = llm.runner.tables.token_pool
    assert pool.device == out.next_tokens.device
    assert int(pool[req.row, req.seq_len]) == int(out.next_tokens[0])
    sched.wait(out)
    sched.process(out)
    nxt = sched.schedule()
    sched.launch(nxt)
    assert nxt.input_ids.tolist() == [req.output_ids[-1]] and nxt.positions.tolist() == [req.seq_len - 1]
    assert torch.equal(nxt.input_ids.cpu(), out.next_tokens.cpu())
