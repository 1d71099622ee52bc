# >>> ch06 file: the two streams
"""Two CUDA streams, so that the scheduler's writes and the forward passes are ordered by events,
not by the host.

    schedule stream  the scheduler's small writes: prompts into token_pool, KV slots into req_to_token,
                     the batch's index tensors
    forward stream   the passes and the sampler; before each step it waits for the stream that
                     launches it (the schedule stream, inside the loop), so a step sees every write
                     made for it, also when a caller drives the scheduler by hand on its own stream

On CPU both are no-ops: the same code runs in the same order, one operation after another. From
chapter 08 the same calls also drive the hazard checker when there is one: it is told which stream the
work goes to, each event recorded or waited for, and each time the host waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
# >>> ch08: events the checker sees
from dataclasses import dataclass
# <<< ch08

import torch

# >>> ch08: the checker
from minioverlap.device.hazard import Clock, HazardChecker
# <<< ch08
# >>> ch08: events the checker sees


@dataclass
class Event:
    """A point on a stream: a CUDA event on a GPU, and the checker's clock there if it is on."""
    cuda: torch.cuda.Event | None
    clock: Clock | None
# <<< ch08


class Streams:
    """The schedule stream and the forward stream (no-ops on a CPU)."""

    # >>> ch08 replaces ch06: the checker
    #| def __init__(self, device: str | torch.device) -> None:
    def __init__(self, device: str | torch.device, hazards: HazardChecker | None = None) -> None:
        self.hazards = hazards
        # <<< ch08
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.schedule_stream = torch.cuda.Stream(device)
            self.forward_stream = torch.cuda.Stream(device)

    # >>> ch08 replaces ch06: the checker
    #| def schedule(self):
    #|     """Make the schedule stream current (the scheduler's loop runs inside this)."""
    #|     return torch.cuda.stream(self.schedule_stream) if self.cuda else nullcontext()
    @contextmanager
    def schedule(self) -> Iterator[None]:
        """Make the schedule stream current (the scheduler's loop runs inside this)."""
        with torch.cuda.stream(self.schedule_stream) if self.cuda else nullcontext(), self.on("schedule"):
            yield
    # <<< ch08

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run a step on the forward stream, after everything queued so far on the stream that launches
        it: the schedule stream inside the loop. From chapter 08, a step that raises is waited for."""
        if self.cuda:
            self.forward_stream.wait_stream(torch.cuda.current_stream(self.forward_stream.device))
        # >>> ch08 replaces ch06: the checker
        #| with torch.cuda.stream(self.forward_stream) if self.cuda else nullcontext():
        #|     yield
        with torch.cuda.stream(self.forward_stream) if self.cuda else nullcontext(), self.on("forward", wait=True):
            try:
                yield
            except BaseException:                # a step that failed half-way: its reads reached no fence
                self.drain("a step that failed")
                raise
        # <<< ch08

    def timestamp(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream (CUDA), or None on CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    # >>> ch08: events, the fence, host waits

    def record(self, cuda: torch.cuda.Event | None = None) -> Event | None:
        """An event on the current stream: everything queued there so far (`cuda`: one just recorded,
        to use). None on a CPU with no checker."""
        if not (self.cuda or self.hazards):
            return None
        if self.cuda and cuda is None:
            cuda = torch.cuda.Event()
            cuda.record()
        return Event(cuda, self.hazards.record() if self.hazards else None)

    def fence(self, shared_read_done: Event | None) -> None:
        """The schedule stream waits until the step just launched has read the shared tables: for its
        event if it recorded one, else for everything on the forward stream. The host does not wait."""
        if shared_read_done is not None:
            if shared_read_done.cuda is not None:
                self.schedule_stream.wait_event(shared_read_done.cuda)
            if shared_read_done.clock is not None:
                self.hazards.wait_event(shared_read_done.clock)
            return
        if self.cuda:
            self.schedule_stream.wait_stream(self.forward_stream)
        if self.hazards:
            self.hazards.wait_stream("forward")

    def host_wait(self, event: Event | None, site: str) -> None:
        """Block the host until the event has happened: the one kind of wait the loop allows."""
        if event is None:
            return
        if event.cuda is not None:
            event.cuda.synchronize()
        if event.clock is not None:
            self.hazards.host_wait(event.clock, site)

    def drain(self, site: str) -> None:
        """Block the host until all that the forward stream has queued has run: what a step that failed
        half-way through leaves behind (reads of the shared tables that no event or fence covers)."""
        if self.cuda:
            self.forward_stream.synchronize()
        if self.hazards:
            self.hazards.host_wait(self.hazards.record("forward"), site)

    @contextmanager
    def on(self, stream: str, wait: bool = False) -> Iterator[None]:
        """Tell the checker that the work queued inside goes to `stream`, which first waits, if `wait`,
        for all that the current stream has queued (stream.wait_stream(torch.cuda.current_stream()))."""
        if not self.hazards:
            yield
            return
        previous, self.hazards.current = self.hazards.current, stream
        try:
            if wait:
                self.hazards.wait_stream(previous)
            yield
        finally:
            self.hazards.current = previous
    # <<< ch08
