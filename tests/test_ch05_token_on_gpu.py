"""Chapter 05: the sampled token stays on the device; the next step is launched without it."""

from __future__ import annotations

import pytest
import torch

from conftest import run_example
from minioverlap import LLM, SamplingParams


def test_step_n_plus_1_launches_before_the_host_has_token_n():
    """Launch step N+1 before handling step N: step N+1's inputs are step N's sampled tokens, read from
    token_pool on the device while the host has handled none of them, and every token equals the normal
    loop's. So launching never needs a token value on the host."""
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
        out = sched.launch(sched.schedule())                  # step N+1, with step N unhandled ...
        if torch.cuda.is_available():
            torch.cuda.synchronize()                          # the test's own look at the device tensors
        assert out.input_ids.tolist() == last.next_tokens[:, 0].tolist(), "... runs on step N's tokens"
        sched.wait(last)
        sched.process(last)                                   # ... and only then step N's tokens arrive
        last = out
    sched.wait(last)
    sched.process(last)
    assert [r.output_ids for r in reqs] == expected
    llm.check_integrity()


def test_the_sampler_writes_the_next_input_into_token_pool():
    """After launch (and the wait for its copy), before the host handles the step, token_pool[row, seq_len]
    holds the sampled token (it held -1 before the launch): the step itself wrote it into the device table. The request's
    seq_len already counts the launched step (the CPU's state moves at launch); the next step reads it."""
    llm = LLM(model="tiny")
    sched = llm.scheduler
    [req] = llm.make_requests(["def f(x):"], SamplingParams(max_tokens=4))
    sched.add_request(req)
    sched.receive()
    batch = sched.schedule()
    pool = llm.runner.tables.token_pool
    pool[req.row, len(req.prompt_ids)] = -1                  # no token id: only the step can overwrite it
    out = sched.launch(batch)
    sched.wait(out)                # on a GPU the step runs on the forward stream: its copy-done event follows the write
    assert req.seq_len == len(req.prompt_ids) and req.output_ids == []
    assert int(pool[req.row, req.seq_len]) == int(out.next_tokens[0, 0]) != -1
    sched.process(out)
    nxt = sched.launch(sched.schedule())
    if torch.cuda.is_available():
        torch.cuda.synchronize()                              # the test's own look at the device tensors
    assert nxt.input_ids.tolist() == [req.output_ids[-1]] and nxt.batch.positions.tolist() == [req.seq_len - 1]
    assert torch.equal(nxt.input_ids.cpu(), out.next_tokens[:, 0].cpu())


@pytest.mark.process
def test_the_example_shows_the_host_one_step_behind_the_device():
    """`python examples/ch05_token_on_gpu.py`: right after launching step N the host's seq_len counts
    it (8 + N for a 9-token prompt), it has received N - 2 tokens, the device holds N; the six tokens
    equal the normal loop's."""
    import json
    import re
    out = run_example("examples/ch05_token_on_gpu.py")
    rows = re.findall(r"^ +step (\d) +(\d+) +(\[[\d, ]*\]) +(\[[\d, ]*\])$", out, re.MULTILINE)
    assert [int(n) for n, *_ in rows] == [1, 2, 3, 4, 5, 6]
    for n, seq_len, received, device in rows:
        n = int(n)
        assert int(seq_len) == 8 + n and len(json.loads(received)) == max(0, n - 2) and len(json.loads(device)) == n
    assert "equal to the normal loop: True" in out
