# >>> ch03 file: many requests, one batch
"""Chapter 03: serving many requests at once: one ragged prefill for all, then batched decode steps.

The batch is rebuilt every step from the requests still running, so a request that finishes leaves
it at once and frees its pages and its slot. (Letting new requests join between steps is the
scheduler's job, chapter 04.)
"""

from __future__ import annotations

from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample


def generate_batch(runner: ModelRunner, reqs: list[Req]) -> None:
    """Run every request to its end; each one's tokens land in req.output_ids."""
    for req in reqs:
        runner.admit(req)
    running, mode = list(reqs), ForwardMode.EXTEND
    while running:
        batch = runner.batch(mode, running)
        tokens = sample(runner.logits(batch), running).tolist()     # the host waits for the device here
        for req, token in zip(running, tokens):
            req.output_ids.append(token)
            runner.write_next_token(req, token)      # the next step's input, into token_pool
            req.finish_reason = req.check_stop()
            if req.finished:
                runner.release(req)
        running, mode = [r for r in running if not r.finished], ForwardMode.DECODE


def serve(llm, reqs: list[Req]) -> None:
    """LLM.generate's path in chapter 03: the requests in groups of max_running, each group one batch."""
    for start in range(0, len(reqs), llm.max_running):
        generate_batch(llm.runner, reqs[start:start + llm.max_running])
