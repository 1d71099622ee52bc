# >>> ch04 file: the event trace
"""The event trace: what the scheduler did, step by step, in the order it happened.

For each step N both loops record, each as its phase ends: `schedule` (the batch is chosen), `launch`
(its work is queued), `wait` (the step's result has reached the host), `process` (the result is
handled: tokens appended, stop rules, frees) and `reply` (the handled tokens went to the clients).
Each mechanism that the chapters add records its own events, where it happens:

    receive   (16) requests that arrived while the last step ran (a server's loop)
    hit       (17) requests whose prefill starts after a prefix found in the cache
    chunk     (18) requests whose rows in the step are a chunk of their prompt (more of it follows)
    mask      (19) a constrained step's masks filled and its sample queued, once the step before it
              has been handled (the overlap loop)
    grammar   (19) requests whose grammar has compiled leave the grammar queue (the step is the last
              one scheduled)
    share     (20) with several ranks, before each iteration: the inbox became rank 0's (the requests
              that arrived with it)
    agree     (20) under DP attention, every rank's token count for the step; `idle`: the empty batch
              of a rank with nothing to run
"""

from __future__ import annotations

import time
from dataclasses import dataclass

KINDS = ("schedule", "launch", "wait", "process", "reply")   # every step's; the chapters add theirs (above)


@dataclass(frozen=True)
class TraceEvent:
    kind: str                  # one of KINDS, or one a chapter adds (the module's docstring)
    step: int                  # N, counting from 1 in each run
    t_ns: int                  # host time.perf_counter_ns() when it happened
    uids: tuple[int, ...]      # the requests of the step's batch (of the replies, for `reply`)


class Trace(list):
    """A list of TraceEvents, oldest first."""
    # >>> ch06: GPU timestamps

    def __init__(self) -> None:
        super().__init__()
        self.gpu: dict[int, tuple[float, float]] = {}   # step -> (start, end) on the GPU, ms from step 1's start
        self.gpu_origin = None

    def record_gpu(self, step: int, start, end) -> None:
        """Keep a handled step's GPU start and end (CUDA timing events, complete by now); None on CPU."""
        if start is None:
            return
        self.gpu_origin = self.gpu_origin or start
        self.gpu[step] = (self.gpu_origin.elapsed_time(start), self.gpu_origin.elapsed_time(end))

    def gpu_gaps_ms(self) -> list[float]:
        """The GPU's idle time before each step: gpu_start(N) - gpu_end(N-1)."""
        steps = sorted(self.gpu)
        return [self.gpu[b][0] - self.gpu[a][1] for a, b in zip(steps, steps[1:])]
    # <<< ch06

    def record(self, kind: str, step: int, uids: tuple[int, ...] | list[int]) -> None:
        self.append(TraceEvent(kind, step, time.perf_counter_ns(), tuple(uids)))
    # >>> ch16: a server's run may never end

    def keep_last(self, n: int) -> None:
        """Drop all but the last n events, and the GPU times of the steps they leave, once there are 2n."""
        if len(self) >= 2 * n:
            del self[:-n]
            self.gpu = {step: span for step, span in self.gpu.items() if step >= self[0].step}
    # <<< ch16

    def order(self, kinds: tuple[str, ...] = ("launch", "process")) -> list[str]:
        """The events of the given kinds as 'launch 1', 'handle 1', ... ('process' reads as 'handle')."""
        return [f"{'handle' if e.kind == 'process' else e.kind} {e.step}" for e in self if e.kind in kinds]

    def phase_times_us(self) -> dict[str, float]:
        """Mean host time of each phase, in microseconds. An event is recorded as its phase ends, so a
        phase lasts from the event before it: 'launch' is the time to queue the step (on a CPU, to run it)."""
        spans: dict[str, list[int]] = {}
        # >>> ch18 replaces ch04: `hit` (17) and `chunk` mark a step's requests; no phase ends with them
        #| for a, b in zip(self, self[1:]):
        #|     spans.setdefault(b.kind, []).append(b.t_ns - a.t_ns)
        phases = [e for e in self if e.kind not in ("hit", "chunk")]
        for a, b in zip(phases, phases[1:]):
            spans.setdefault(b.kind, []).append(b.t_ns - a.t_ns)
        # <<< ch18
        return {kind: sum(v) / len(v) / 1e3 for kind, v in spans.items()}
    # >>> ch14: the host's work per step

    def host_ms_per_step(self) -> float:
        """The host's own work per step, in ms: the mean length of every phase but `wait`, summed. Without
        overlap the device idles through the part of it between steps; with overlap it runs beside a step."""
        # >>> exercise 14.1: the host's work per step
        return sum(us for kind, us in self.phase_times_us().items() if kind != "wait") / 1e3
        # <<< exercise 14.1
    # <<< ch14
# >>> ch06: a file for Perfetto


def chrome_trace(traces: dict[str, Trace], starts: dict[str, int] | None = None) -> dict:
    """Chrome trace-event JSON (Perfetto and chrome://tracing open it): one process per loop; its host
    thread is one track, each phase a slice that lasts from the event before to its own. The first
    phase has no event before it: it starts at the run's start, `starts[loop]` (a perf_counter_ns time
    taken just before the run), or, without one, it is a slice of no length at its own time. On a GPU
    the forward stream is a second track, each step a slice. CUDA events share no clock with the host,
    so the GPU track starts step 1 when the host scheduled it: the alignment is approximate, the GPU's
    own spans and gaps are exact. On a CPU there is no second track: `launch` runs the step."""
    events: list[dict] = []
    for pid, (loop, trace) in enumerate(traces.items(), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{loop} loop"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "scheduler (host)"}})
        t0 = min(trace[0].t_ns, (starts or {}).get(loop, trace[0].t_ns))     # the time axis's 0
        for before, e in zip([t0, *(e.t_ns for e in trace)], trace):
            events.append({"ph": "X", "name": f"{e.kind} {e.step}", "pid": pid, "tid": 1, "ts": (before - t0) / 1e3,
                           "dur": (e.t_ns - before) / 1e3, "args": {"requests": list(e.uids)}})
        if trace.gpu:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "forward stream (GPU)"}})
        scheduled = (trace[0].t_ns - t0) / 1e3       # step 1's GPU start goes where the host scheduled it
        for step, (start, end) in sorted(trace.gpu.items()):
            events.append({"ph": "X", "name": f"step {step}", "pid": pid, "tid": 2,
                           "ts": scheduled + start * 1e3, "dur": (end - start) * 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
# <<< ch06
