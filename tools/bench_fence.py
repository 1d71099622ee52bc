"""What the guards of chapter 08 do on a real GPU (needs CUDA).

    python tools/bench_fence.py          # 1 and 2
    python tools/bench_fence.py --mtp    # 3

1. A race made visible. One request slot: A stops on its second token, B takes A's slot at once.
   A delay planted on the GPU before the LM head (torch.cuda._sleep) holds every step's sampler back
   by about 10 ms, so that the scheduler's unordered writes land first whenever they can. B's tokens
   are compared with a run that has no delay and chapter 07's deferred release.
2. What the fence costs. With about 2 ms planted per step, so that the GPU step outlasts the host's
   work as on a larger model, the median GPU gap between steps of the overlap loop with the fence's
   event (the default), with its fallback (the schedule stream waits for the whole forward stream),
   with no fence, and each fence with blocking host-to-device copies on the schedule stream
   (torch.tensor(..., device=...), from pageable memory) in place of `to_device`.
3. The read-done event with MTP (chapter 12). One request slot, mtp_steps=3, the overlap loop: A stops
   on its second token while its wasted window is in flight, and B, whose prompt is longer than A's
   length, takes A's slot at once, with its prompt written by the scheduler (chapter 08's prompt guard
   off). The delay before every LM head holds the verify's window write back. With the event after the
   draft extend (the default) the scheduler's prompt write waits for it; with chapter 08's placement
   (build stage 12 with fix 'read-done-after-draft-extend' reverted and run this there) it does not,
   and A's window can land on B's prompt.
"""

from __future__ import annotations

import statistics

import torch

import minioverlap.cache.req_to_token as req_to_token_module
import minioverlap.engine.forward_batch as forward_batch_module
import sys

from minioverlap import LLM, SamplingParams
from minioverlap.config import Guards
from minioverlap.device.transfer import to_device

PROMPT_A, PROMPT_B = "def f(x):", "class Stack:\n    def __init__(self):\n        self.items = []"
CODE = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]


def plant_delay(llm: LLM, cycles: int) -> None:
    """Make every step spend `cycles` GPU clock cycles before its LM head (and so before its sampler)."""
    logits = llm.model.compute_logits

    def slow(hidden: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(cycles)
        return logits(hidden)
    llm.model.compute_logits = slow


def handover(delay: bool, fence: bool = True, defer_release: bool = False,
             prompt_on_forward_stream: bool = True) -> list[list[int]]:
    guards = Guards(fence=fence, defer_release=defer_release, prompt_on_forward_stream=prompt_on_forward_stream)
    # the handover needs B to take A's pages as A frees them: no prefix cache to keep them (chapter 17)
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_running=1, page_size=4, guards=guards, prefix_cache=False)
    if delay:
        plant_delay(llm, 20_000_000)
    a = llm.encode(PROMPT_A)
    stop = LLM(model="tiny").generate([a], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids[1]
    outs = llm.generate([a, PROMPT_B], [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)),
                                        SamplingParams(max_tokens=8, ignore_eos=True)])
    return [o.token_ids for o in outs]


def mtp_handover(delay: bool, **guards: bool) -> list[list[int]]:
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_running=1, page_size=4, mtp_steps=3,
              guards=Guards(**guards), prefix_cache=False)    # B takes A's pages as A frees them
    if delay:
        plant_delay(llm, 20_000_000)
    outs = llm.generate([PROMPT_A, PROMPT_B], [SamplingParams(max_tokens=2, ignore_eos=True),
                                                SamplingParams(max_tokens=8, ignore_eos=True)])
    return [o.token_ids for o in outs]


def mtp_main() -> None:
    reference = mtp_handover(False, fence=False, defer_release=True)
    print("3. MTP: B's tokens with a ~10 ms delay before every LM head, against a run without delay:")
    for label, guards in [("defaults", {}), ("prompt written on the schedule stream", {"prompt_on_forward_stream": False}),
                          ("fence off", {"fence": False})]:
        got = mtp_handover(True, **guards)
        print(f"   {label:40s} B {'equal' if got[1] == reference[1] else 'DIFFERENT'}")


def pageable(values: list[int], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def gap_engine(variant: str) -> LLM:
    llm = LLM(model="tiny", device="cuda", fence=variant != "no fence", prefix_cache=False)   # as recorded in chapter 08
    if variant.startswith("fallback"):
        fence = llm.runner.streams.fence
        llm.runner.streams.fence = lambda event: fence(None)
    plant_delay(llm, 4_000_000)
    return llm


def median_gap(llm: LLM, blocking: bool) -> float:
    req_to_token_module.to_device = forward_batch_module.to_device = pageable if blocking else to_device
    try:
        llm.generate(CODE, SamplingParams(max_tokens=32, ignore_eos=True))
    finally:
        req_to_token_module.to_device = forward_batch_module.to_device = to_device
    return statistics.median(llm.trace.gpu_gaps_ms())


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_fence.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--mtp" in sys.argv[1:]:
        mtp_main()
        return
    reference = handover(False, defer_release=True)
    print("1. B's tokens with a ~10 ms delay before every sampler, against a run without delay:")
    for label, guards in [("defaults", {}), ("fence off", {"fence": False}),
                          ("prompt written on the schedule stream", {"prompt_on_forward_stream": False})]:
        got = handover(True, **guards)
        print(f"   {label:40s} B {'equal' if got[1] == reference[1] else 'DIFFERENT'}")
    variants = ["event (default)", "fallback", "no fence", "event + blocking copies", "fallback + blocking copies"]
    engines = {v: gap_engine(v) for v in variants}
    gaps: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(4):                                   # round 0 warms up; the variants take turns
        for v in variants:
            gap = median_gap(engines[v], "blocking" in v)
            if rnd:
                gaps[v].append(gap)
    print("2. median GPU gap between steps (overlap loop, ~2 ms planted per step, 4 requests x 32 tokens, median of 3):")
    for v in variants:
        print(f"   {v:30s} {statistics.median(gaps[v]):.3f} ms")


if __name__ == "__main__":
    main()
