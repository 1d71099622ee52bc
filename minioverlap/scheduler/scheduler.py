# >>> ch04 file: the scheduler
"""The scheduler: the loop that turns requests into steps and steps into replies.

One iteration of the normal loop does five things, in this order:

    receive   take new requests and aborts from the inbox
    schedule  choose the next batch: admit waiting requests (a prefill step) or decode the running ones
    launch    queue the step's work: forward, sample, copy the tokens back to the host
    wait      block until the copy is done (on a GPU: the copy-done event)
    process   append each token, apply the stop rules, free what finished, reply to the clients

Admission is what keeps it from crashing when the cache is full: a request is admitted only when a
request slot is free and the free pages cover everything it may still need, counting what the
running requests may still need. Otherwise it waits in the queue; nothing is lost, nothing fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

# >>> ch08: events the checker sees
from minioverlap.device.streams import Event
# <<< ch08
from minioverlap.device.trace import Trace
from minioverlap.engine.forward_batch import ForwardBatch, ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.engine.sampler import sample


@dataclass
class Reply:
    """What a streaming client receives after a step: its new tokens, and whether it is done."""
    uid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass(eq=False)
class StepOutput:
    """A launched step. It keeps its tensors alive until the step is handled.

    NOTE: on a GPU the step may still be running when the host moves on; if its batch's tensors were
    freed, the allocator could hand their memory to the next step while this one still reads it."""
    step: int
    batch: ForwardBatch
    next_tokens: torch.Tensor            # [B] on the device
    next_tokens_cpu: torch.Tensor        # [B] on the host, valid once copy_done has completed
    # >>> ch08 replaces ch04: an event the checker sees too
    #| copy_done: torch.cuda.Event | None   # None on CPU, where the copy is done when it returns
    copy_done: Event | None              # None on CPU with no checker: the copy is done when it returns
    # <<< ch08
    # >>> ch06: GPU timestamps of the step (None on CPU)
    gpu_events: tuple[torch.cuda.Event | None, torch.cuda.Event | None] = (None, None)   # start, end
    # <<< ch06


class IntegrityError(RuntimeError):
    """A page, KV slot or request slot that is lost, or owned twice."""


class Scheduler:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.inbox: deque[tuple[str, Req | int]] = deque()   # ("add", req) or ("abort", uid)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.trace = Trace()
        self.step = 0
        # >>> ch06: the overlap loop
        self.streams = runner.streams
        self.in_flight: list[StepOutput] = []     # launched, not yet handled
        # <<< ch06
        # >>> ch08: the guards of the shared tables (chapter 08 says which orders which write)
        self.fence = True              # the schedule stream waits for each launched step's shared reads
        self.defer_release = False     # chapter 07's guard: keep a finished request's slot until its step is handled
        # <<< ch08
        # >>> ch07 fix slot-reuse: requests whose slot and pages wait for an in-flight step to be handled
        self.deferred: list[tuple[int, Req]] = []   # (the step that must be handled first, the request)
        # <<< ch07

    # ---- the client's side: messages into the inbox
    def add_request(self, req: Req) -> None:
        """Queue a request for the next receive; one that could never fit the pool is refused now."""
        pages, pool = self.pages_needed(req), self.runner.allocator.num_pages - 1
        if pages > pool:
            raise ValueError(f"prompt + max_tokens = {len(req.prompt_ids) + req.max_new_tokens} tokens need {pages} "
                             f"pages; the pool has {pool}")
        self.inbox.append(("add", req))

    def abort(self, uid: int) -> None:
        self.inbox.append(("abort", uid))

    @property
    def busy(self) -> bool:
        return bool(self.inbox or self.waiting or self.running)

    def start_run(self) -> None:
        self.trace, self.step = Trace(), 0

    # ---- the loop
    def normal_loop(self) -> list[Reply]:
        """One iteration: receive, schedule, launch, wait, process."""
        replies = self.receive()
        batch = self.schedule()
        if batch is None:
            return replies
        out = self.launch(batch)
        self.wait(out)
        return replies + self.process(out)
    # >>> ch06: the overlap loop

    def overlap_loop(self, last: StepOutput | None) -> tuple[StepOutput | None, list[Reply]]:
        """One iteration: schedule and launch step N+1, then wait for and handle step N (`last`).

        Launching first is what keeps the device busy: while it runs step N+1, the host handles
        step N. Step N+1 was built without step N's tokens; they are on the device already (05)."""
        # >>> exercise 06.1: the overlap loop
        replies = self.receive()
        batch = self.schedule()
        out = self.launch(batch) if batch is not None else None
        if last is not None:
            self.wait(last)
            replies += self.process(last)
        return out, replies
        # <<< exercise 06.1
    # <<< ch06

    def receive(self) -> list[Reply]:
        replies = []
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add":
                self.waiting.append(item)
            elif (req := self.find(item)) is not None:
                replies.append(self.abort_now(req))
        return replies

    def schedule(self) -> ForwardBatch | None:
        """Prefill newly admitted requests if any fit, else decode every running request."""
        # >>> ch08: the checker names the step in its reports
        if self.runner.hazards:
            self.runner.hazards.step = self.step + 1
        # <<< ch08
        new = self.admit()
        # >>> ch06 replaces ch04: only requests that may take another step (the CPU counts what it launched)
        #| decode = list(self.running)
        decode = [r for r in self.running if r.can_decode]
        # <<< ch06
        mode, reqs = (ForwardMode.EXTEND, new) if new else (ForwardMode.DECODE, decode)
        if not reqs:
            return None
        self.step += 1
        batch = self.runner.batch(mode, reqs)
        self.trace.record("schedule", self.step, [r.uid for r in reqs])
        return batch

    def launch(self, batch: ForwardBatch) -> StepOutput:
        # >>> ch06 replaces ch04: on the forward stream, after the schedule stream's writes
        #| out = self.run_step(batch)
        with self.streams.forward():
            out = self.run_step(batch)
        self.in_flight.append(out)
        # <<< ch06
        # >>> ch08 fix fence: what the scheduler queues from now on runs after this step's shared reads
        # >>> exercise 08.1: place the fence
        if self.fence:
            self.streams.fence(self.runner.shared_read_done)
        # <<< exercise 08.1
        # <<< ch08
        self.trace.record("launch", self.step, [r.uid for r in batch.reqs])
        return out

    def run_step(self, batch: ForwardBatch) -> StepOutput:
        """Forward, sample, and start copying the tokens to the host."""
        # >>> ch06: GPU timestamps of the step (None on CPU)
        start = self.streams.timestamp()
        # <<< ch06
        next_tokens = sample(self.runner.forward(batch), batch.reqs)
        # >>> ch05: the token stays on the device, where the next step reads it
        # >>> exercise 05.1: keep the token on the device
        self.runner.tables.token_pool[batch.req_pool_indices, batch.seq_lens] = next_tokens.to(torch.int32)
        # <<< exercise 05.1
        # >>> ch08: the checker
        if self.runner.hazards:
            self.runner.hazards.access("token_pool", [(row, p + n) for row, p, n in zip(batch.rows, batch.prefix_lens, batch.extend_lens)],
                                       "write", "the sampler writes the next input tokens")
        # <<< ch08
        # <<< ch05
        # >>> ch06: GPU timestamps of the step (None on CPU)
        end = self.streams.timestamp()
        # <<< ch06
        cpu, copy_done = copy_to_host(next_tokens)
        # >>> ch08: the checker sees the copy-done event too
        copy_done = self.streams.record(copy_done)
        # <<< ch08
        # >>> ch06 replaces ch04: GPU timestamps of the step (None on CPU)
        #| return StepOutput(self.step, batch, next_tokens, cpu, copy_done)
        return StepOutput(self.step, batch, next_tokens, cpu, copy_done, (start, end))
        # <<< ch06

    def wait(self, out: StepOutput) -> None:
        # >>> ch08 replaces ch04: the checker records the host's wait
        #| if out.copy_done is not None:
        #|     out.copy_done.synchronize()           # the one place the host waits for the device
        self.streams.host_wait(out.copy_done, f"the host waits for step {out.step}'s tokens")   # the only host wait
        # <<< ch08
        self.trace.record("wait", out.step, [r.uid for r in out.batch.reqs])

    def process(self, out: StepOutput) -> list[Reply]:
        """Append each request's token, apply the stop rules, free what finished, and reply."""
        # >>> ch06: the step is done; what waited for it can go
        self.in_flight.remove(out)
        self.trace.record_gpu(out.step, *out.gpu_events)
        # <<< ch06
        # >>> ch07 fix slot-reuse: slots and pages that waited for this step to be handled
        self.release_deferred(out.step)
        # <<< ch07
        replies = []
        for req, token in zip(out.batch.reqs, out.next_tokens_cpu.tolist()):
            # >>> exercise 04.2: handle a step's result
            # >>> exercise 07.1: repair the naive result handling
            # >>> ch07 fix stale-reply: finished in an earlier handle, it was launched again; drop the token
            if req.finished:
                continue
            # <<< ch07
            req.output_ids.append(token)
            # >>> ch05 replaces ch04: the sampler wrote the token into token_pool, on the device
            #| self.runner.tables.write_tokens(req.row, req.seq_len, [token])   # the next step's input
            # <<< ch05
            # >>> ch07 fix early-finish replaces ch04: decide by the tokens actually received
            #| if token in req.stop_ids or not req.can_decode:     # by what was launched: one step ahead in the overlap loop
            #|     req.finish_reason = "stop" if token in req.stop_ids else "length"
            req.finish_reason = req.check_stop()
            # <<< ch07
            # >>> ch05 replaces ch04: launched one step ahead, a finished request comes back once, in the step launched before it finished
            #| if req.finished:
            # >>> ch07 fix stale-reply replaces ch05: it was skipped above; only a request finished now gets here
            #| if req.finished and req in self.running:     # free it once (its token is still appended and replied)
            if req.finished:
            # <<< ch07
            # <<< ch05
                self.free(req)
            replies.append(Reply(req.uid, [token], req.finished, req.finish_reason))
            # <<< exercise 07.1
            # <<< exercise 04.2
        self.trace.record("process", out.step, [r.uid for r in out.batch.reqs])
        self.trace.record("reply", out.step, [r.uid for r in replies])
        return replies

    # ---- admission, abort, frees
    def admit(self) -> list[Req]:
        """Admit waiting requests, in order, while a slot is free and the pages cover them."""
        new = []
        while self.waiting and self.fits(self.waiting[0]):
            req = self.waiting.popleft()
            self.runner.admit(req)
            self.running.append(req)
            new.append(req)
        return new

    def fits(self, req: Req) -> bool:
        """Whether req can start now: a request slot is free, and the free pages not yet promised to
        running requests cover every page req may need."""
        # >>> exercise 04.1: admission
        alloc = self.runner.allocator
        promised = sum(self.pages_needed(r) - len(r.pages) for r in self.running)
        return self.runner.tables.num_free > 0 and alloc.num_free - promised >= self.pages_needed(req)
        # <<< exercise 04.1

    def pages_needed(self, req: Req) -> int:
        """Pages for everything the request may hold: its prompt and all but its last new token."""
        return self.runner.allocator.pages_for(len(req.prompt_ids) + req.max_new_tokens - 1)

    def find(self, uid: int) -> Req | None:
        return next((r for r in [*self.waiting, *self.running] if r.uid == uid), None)

    def abort_now(self, req: Req) -> Reply:
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            # >>> ch07 fix abort-in-flight replaces ch04: a step in flight may hold it: free it as a finish is freed
            #| self.running.remove(req)
            #| self.runner.release(req)
            self.free(req)
            # <<< ch07
        return Reply(req.uid, [], True, "abort")

    def free(self, req: Req) -> None:
        self.running.remove(req)
        # >>> ch07 fix slot-reuse: a launched step still writes its row and pages: keep them until it is handled
        # >>> ch08 replaces ch07: only if asked: the fence and the prefill's own prompt write make release at once safe
        #| if self.in_flight:
        if self.defer_release and self.in_flight:
            # <<< ch08
            self.deferred.append((self.in_flight[-1].step, req))
            return
        # <<< ch07
        self.runner.release(req)
    # >>> ch07 fix slot-reuse: release what waited

    def release_deferred(self, handled_step: int) -> None:
        for step, req in [d for d in self.deferred if d[0] <= handled_step]:
            self.deferred.remove((step, req))
            self.runner.release(req)
    # <<< ch07

    def check_integrity(self) -> None:
        """Every page and request slot is free or owned by exactly one running request, and each
        running request's req_to_token row points at its own pages."""
        alloc, tables, problems = self.runner.allocator, self.runner.tables, []
        owners = list(self.running)
        # >>> ch07 fix slot-reuse: deferred requests still own theirs
        owners += [req for _, req in self.deferred]
        # <<< ch07
        owned_pages = [p for r in owners for p in r.pages]
        owned_rows = [r.row for r in owners]
        for what, owned, free, total in (("page", owned_pages, alloc.free_pages, alloc.num_pages),
                                         ("request slot", owned_rows, tables.free_rows, len(tables.is_free))):
            counts = {i: 0 for i in range(1, total)}
            for i in [*owned, *free]:
                counts[i] = counts.get(i, 0) + 1
            problems += [f"{what} {i} is {'lost' if n == 0 else f'owned or free {n} times'}"
                         for i, n in counts.items() if n != 1]
        problems += [f"waiting request {r.uid} holds a slot or pages" for r in self.waiting if r.row or r.pages]
        for r in owners:
            expected = alloc.kv_slots(r.pages, 0, r.seq_len)
            if tables.req_to_token[r.row, :r.seq_len].tolist() != expected:
                problems.append(f"request {r.uid}: req_to_token row {r.row} does not point at its pages")
        if problems:
            raise IntegrityError("; ".join(problems))


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying t to the host; on a GPU the copy runs behind the step and records an event."""
    if t.device.type != "cuda":
        return t, None
    cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    cpu.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return cpu, done
