# >>> ch02 file: chapter 01's greedy loop on the paged cache
"""Chapter 01's greedy loop on the paged cache: one request, prefill then one token per step. The host
reads every token back before it launches the next step; chapter 04's scheduler serves many requests."""

from __future__ import annotations

from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams


def paged_greedy_generate(runner: ModelRunner, prompt: list[int], max_tokens: int,
                          eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens for one prompt, its K/V in pages of the runner's pool."""
    req = Req(0, list(prompt), SamplingParams(max_tokens), max_tokens, frozenset(eos_token_ids))
    runner.admit(req)
    try:
        batch = runner.batch(ForwardMode.EXTEND, [req])
        while True:
            req.output_ids.append(int(runner.logits(batch).argmax(dim=-1)))
            # >>> ch03: the next step reads its input from token_pool
            runner.write_next_token(req, req.output_ids[-1])
            # <<< ch03
            if req.check_stop():
                return req.output_ids
            batch = runner.batch(ForwardMode.DECODE, [req])
    finally:
        runner.release(req)


def serve(llm, reqs: list[Req]) -> None:
    """LLM.generate's path in chapter 02: each request in turn, on the paged cache."""
    for req in reqs:
        req.output_ids = paged_greedy_generate(llm.runner, req.prompt_ids, req.max_new_tokens, tuple(req.stop_ids))
        req.finish_reason = req.check_stop()
