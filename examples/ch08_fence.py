"""Chapter 08: the hazard checker's report with a guard removed, silence with the defaults, and what
chapter 07's host-side guard costs next to the fence.

    python examples/ch08_fence.py

The scenario: one request slot. Request A stops on a stop token at step k; step k+1, launched before
the host knew, still reads and writes A's row when the row goes to request B. On a CPU nothing goes
wrong that you could see; the checker shows what could on a GPU.

It serves that scenario four times with the checker recording every access, then 16 requests six
times: about 10 s on one PyTorch thread, which it sets itself. Nothing it prints is a time, and the tiny
model's matrices are too small to share out; on a busy machine torch's default pool of threads spins
while it waits and made the same runs take minutes.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardError

PROMPT_A, PROMPT_B = "def f(x):", "class Stack:\n    def __init__(self):\n        self.items = []"


def handover(fence: bool = True, defer_release: bool = False, prompt_on_forward_stream: bool = True) -> str:
    """Run the scenario with the checker on; return its report, or a line saying it stayed silent."""
    guards = Guards(fence=fence, defer_release=defer_release, prompt_on_forward_stream=prompt_on_forward_stream)
    llm = LLM(model="tiny", max_running=1, page_size=4, hazard_check=True, guards=guards)
    a = llm.encode(PROMPT_A)
    stop = LLM(model="tiny").generate([a], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids[1]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    try:                                            # B waits for the one slot, and gets it when A stops
        llm.generate([a, PROMPT_B], params)
    except HazardError as error:
        return f"HazardError: {error}"
    return f"silent ({len(llm.runner.hazards.host_waits)} host waits, all for copy-done events)"


def bubbles(defer_release: bool, max_running: int) -> tuple[int, int]:
    """(launches made with no step in flight, steps) serving 16 prompts that mostly stop on a newline."""
    llm = LLM(model="tiny", max_running=max_running, page_size=4, guards=Guards(defer_release=defer_release))
    newline = llm.encode("\n")[0]
    prompts = ["def f(x):", "import os\n", "class A:", "x = 1", "for i in range(3):", "y = [", "def g():", "z ="] * 2
    llm.generate(prompts, SamplingParams(max_tokens=16, stop_token_ids=(newline,)))
    launched = waited = idle = 0
    for event in llm.trace:
        if event.kind == "launch":
            idle += 0 < launched == waited            # every earlier step had been waited for
            launched += 1
        waited += event.kind == "wait"
    return idle, launched


def main() -> None:
    torch.set_num_threads(1)
    console = Console()
    console.print("4 runs with the hazard checker on, then 6 runs of 16 requests: about 10 s")
    console.rule("guards removed one at a time (overlap loop, hazard_check=True)")
    for label, guards in [("defaults: fence on, slot released at once, prompt written by its prefill", {}),
                          ("fence off", {"fence": False}),
                          ("fence off, chapter 07's deferred release instead", {"fence": False, "defer_release": True}),
                          ("prompt written by the scheduler, on the schedule stream", {"prompt_on_forward_stream": False})]:
        console.print(f"[bold]{label}[/bold]")
        console.print(f"  {handover(**guards)}", soft_wrap=True, highlight=False)
    console.rule("what the deferred release costs (CPU, 16 requests)")
    table = Table("max_running", "release", "launches with nothing in flight", "steps")
    for max_running in (1, 2, 4):
        for defer in (True, False):
            idle, steps = bubbles(defer, max_running)
            table.add_row(str(max_running), "deferred (ch07)" if defer else "at once (fence)", str(idle), str(steps))
    console.print(table)


if __name__ == "__main__":
    main()
