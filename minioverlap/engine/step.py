# >>> ch04 file: a launched step
"""StepOutput: a step the engine has launched, as the scheduler holds it until the step is handled."""

from __future__ import annotations

from dataclasses import dataclass
# >>> ch19: a step whose sample was put off
from collections.abc import Callable
# <<< ch19

import torch

# >>> ch08: events the checker sees
from minioverlap.device.streams import Event
# <<< ch08
from minioverlap.engine.forward_batch import ForwardBatch
# >>> ch16: logprobs, copied with the tokens
from minioverlap.engine.logprobs import StepLogprobs
# <<< ch16


@dataclass(eq=False)
class StepOutput:
    """A launched step. It keeps its tensors alive until the step is handled.

    Every step gives each request a window of W tokens, of which accept_lens count: a plain step a
    window of one token, accepted (W = 1); chapter 09's speculative steps give k+1, of which 1..k+1 count.

    NOTE: on a GPU the step may still be running when the host moves on; if its batch's tensors were
    freed, the allocator could hand their memory to the next step while this one still reads it."""
    step: int
    batch: ForwardBatch
    input_ids: torch.Tensor              # [T] the tokens the step ran, on the device
    next_tokens: torch.Tensor            # [B, W] each request's window of new tokens, on the device
    next_tokens_cpu: torch.Tensor        # [B, W] on the host, valid once copy_done has completed
    accept_lens: torch.Tensor            # [B] how many tokens of each window count
    accept_lens_cpu: torch.Tensor        # [B] on the host, valid once copy_done has completed
    # >>> ch08 replaces ch04: an event the checker sees too
    #| copy_done: torch.cuda.Event | None   # None on CPU, where the copy is done when it returns
    copy_done: Event | None              # None on CPU with no checker: the copy is done when it returns
    # <<< ch08
    # >>> ch08: the event the fence waits for: the step has read the tables the scheduler writes
    read_done: Event | None = None
    # <<< ch08
    # >>> ch06: GPU timestamps of the step (None on CPU)
    gpu_events: tuple[torch.cuda.Event | None, torch.cuda.Event | None] = (None, None)   # start, end
    # <<< ch06
    # >>> ch16: the logprobs, if a request of the step asked: computed with its sample, copied before its tokens
    logprobs: StepLogprobs | None = None
    # <<< ch16
    # >>> ch19: a step launched with its sample put off: what queues the rest, once its masks can be filled
    sample_later: Callable[[StepOutput], StepOutput] | None = None
    # <<< ch19

    def token_lists(self) -> list[list[int]]:
        """Each request's tokens of the step, on the host: its window, cut to its accept length."""
        return [row[:n] for row, n in zip(self.next_tokens_cpu.tolist(), self.accept_lens_cpu.tolist())]
