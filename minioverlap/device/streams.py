# >>> ch06 file: the two streams
"""Two CUDA streams, so that the scheduler's writes and the forward passes are ordered by events,
not by the host.

    schedule stream  the scheduler's small writes: prompts into token_pool, KV slots into req_to_token,
                     the batch's index tensors
    forward stream   the passes and the sampler; it waits for the schedule stream before each step,
                     so a step sees every write made for it

On CPU both are no-ops: the same code runs in the same order, one operation after another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


class Streams:
    def __init__(self, device: str | torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.schedule_stream = torch.cuda.Stream(device)
            self.forward_stream = torch.cuda.Stream(device)

    def schedule(self):
        """Make the schedule stream current (the scheduler's loop runs inside this)."""
        return torch.cuda.stream(self.schedule_stream) if self.cuda else nullcontext()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run a step on the forward stream, after everything the schedule stream has queued so far."""
        if not self.cuda:
            yield
            return
        self.forward_stream.wait_stream(self.schedule_stream)
        with torch.cuda.stream(self.forward_stream):
            yield

    def timestamp(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream (CUDA), or None on CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
