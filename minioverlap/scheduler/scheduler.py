# >>> ch04 file: the scheduler
"""The scheduler: the loop that turns requests into steps and steps into replies.

One iteration of the normal loop does five things, in this order:

    receive   take new requests and aborts from the inbox
    schedule  choose the next batch: admit waiting requests (a prefill step) or decode the running ones
    launch    have the model runner queue the step: forward, sample, copy the tokens back to the host
    wait      block until the copy is done (on a GPU: the copy-done event)
    process   append each token, apply the stop rules, free what finished, reply to the clients

Each step's choice is a PrefillAdder's (prefill_adder.py). Its admission is what keeps the loop from
crashing when the cache is full: a request is admitted only when a request slot is free and the free
pages cover everything it may still need, counting what the running requests may still need. Otherwise
it waits in the queue; nothing is lost, nothing fails.

The scheduler never touches the device: the runner runs the steps and owns the tables, and the cache
manager (runner.cache) keeps the account of each request's slot and pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
# >>> ch16: a server's requests arrive while the loop runs
from collections.abc import Callable
# <<< ch16

# >>> ch08: the guards
from minioverlap.config import Guards
# <<< ch08
from minioverlap.device.trace import Trace
from minioverlap.engine.forward_batch import ForwardBatch
# >>> ch21: a decode step decays the estimate
from minioverlap.engine.forward_batch import ForwardMode
# <<< ch21
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.scheduler.checks import RuntimeCheckerMixin
# >>> ch19: the requests whose grammar compiles
from minioverlap.scheduler.grammar_manager import GrammarManager
# <<< ch19
from minioverlap.scheduler.output_processor import OutputProcessorMixin, Reply
from minioverlap.scheduler.prefill_adder import PrefillAdder
# >>> ch21: retraction
from minioverlap.scheduler.retraction import Retraction
# <<< ch21


# >>> ch16: a server's run lasts as long as its busy period, for ever under load: its trace keeps the last events
TRACE_EVENTS = 100_000
# <<< ch16


class Scheduler(OutputProcessorMixin, RuntimeCheckerMixin):
    """One engine's scheduler: its queues, its loop, and the choice of each step."""
    # >>> ch21: admission by need and retraction, if the LLM asks (None: admission by every page a request may need)
    retraction: Retraction | None = None
    # <<< ch21
    def __init__(self, runner: ModelRunner) -> None:
        """The inbox (what callers sent since the last iteration), the queues of requests (waiting: not
        admitted yet; running: holding a slot and pages) and the trace of the current run. The chapters
        add: the steps launched but not handled yet (06), the requests whose slot and pages wait for one
        of them (07), the guards (08), the options the LLM sets (16, 18) and the requests whose grammar
        compiles (19)."""
        self.runner, self.cache = runner, runner.cache     # the cache manager: a request's slot and pages
        self.inbox: deque[tuple[str, Req | int]] = deque()   # ("add", req) or ("abort", uid)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.trace = Trace()
        self.step = 0
        # >>> ch06: the overlap loop
        self.in_flight: list[StepOutput] = []     # launched, not yet handled
        # <<< ch06
        # >>> ch07 fix slot-reuse: requests whose slot and pages wait for an in-flight step to be handled
        self.deferred: list[tuple[int, Req]] = []   # (the step that must be handled first, the request)
        # <<< ch07
        # >>> ch16: the time to first token (Scheduler.run's option)
        self.first_tokens_first = False
        # <<< ch16
        # >>> ch08: the guards of the shared tables, the runner's (chapter 08 says which orders which write)
        self.guards: Guards = runner.guards
        # <<< ch08
        # >>> ch18: the prompt tokens a step may run (None: every prompt whole), and mixed steps (the LLM's options)
        self.chunked_prefill_size: int | None = None
        self.mixed_chunk = False
        # <<< ch18
        # >>> ch19: requests whose grammar compiles (SGLang's grammar_queue), and the compiles watched
        self.grammars = GrammarManager(self)
        # <<< ch19

    # ---- the client's side: messages into the inbox
    def submit(self, reqs: list[Req]) -> None:
        """Queue a run's requests for its first receive."""
        for req in reqs:
            self.add_request(req)

    def add_request(self, req: Req) -> None:
        """Queue a request for the next receive (a run in progress)."""
        self.inbox.append(("add", req))
        # >>> ch19: its grammar's compile, watched until it is done
        self.grammars.watch(req)
        # <<< ch19

    def abort(self, uid: int) -> None:
        self.inbox.append(("abort", uid))

    @property
    def busy(self) -> bool:
        """Whether a request is queued or running."""
        # >>> ch19 replaces ch04: the grammar queue too
        #| return bool(self.inbox or self.waiting or self.running)
        return bool(self.inbox or self.grammars or self.waiting or self.running)
        # <<< ch19

    # ---- the loop
    def run(self,
            # >>> ch06: which loop
            overlap: bool = False,
            # <<< ch06
            # >>> ch16: a server's requests arrive while the loop runs
            receive: Callable[[], bool] | None = None,
            first_tokens_first: bool = False,
            # <<< ch16
            ) -> Iterator[Reply]:
        """Iterate the loop until every request is done, yielding the replies as they are made. Each
        iteration runs inside the schedule stream (06), never across a yield: the caller's code between
        replies runs on its own stream."""
        self.trace, self.step = Trace(), 0
        # >>> ch16: a server's arrivals, and the time to first token
        # A server's `receive`, called after every iteration's replies, puts what arrived since (new
        # requests, aborts) into the inbox, without waiting, for the next iteration's receive step; False
        # ends the run (the server stops) and aborts what is left. `first_tokens_first`: the overlap
        # loop handles a prefill before it launches the next step (overlap_loop says its price).
        self.first_tokens_first = first_tokens_first
        # <<< ch16
        # >>> ch06 replaces ch04: both loops, side by side
        #| while self.busy:
        #|     yield from self.normal_loop()
        last = None                              # the overlap loop's step in flight
        while self.goes_on(last):
            with self.runner.schedule_stream():
                if overlap:
                    last, replies = self.overlap_loop(last)
                else:
                    replies = self.normal_loop()
            yield from replies
            # >>> ch16: the receive step, made real: what arrived while the iteration ran, for the next one
            if receive is not None and not self.arrivals(receive):
                self.abandon()
                return
            self.trace.keep_last(TRACE_EVENTS)
            # <<< ch16
        # <<< ch06

    # >>> ch16: the receive step, made real

    def arrivals(self, receive: Callable[[], bool]) -> bool:
        """Let the server put what arrived into the inbox; the new requests join the trace as `receive`.
        False: the server stops."""
        # >>> exercise 16.2: the receive step
        before = len(self.inbox)
        going = receive()
        new = [item.uid for kind, item in list(self.inbox)[before:] if kind == "add"]
        if new:
            self.trace.record("receive", self.step, new)
        return going
        # <<< exercise 16.2
    # <<< ch16

    # >>> ch06: a run goes on while a step is in flight

    def goes_on(self, last: StepOutput | None) -> bool:
        """Whether the run goes on: a request is queued or running, or the overlap loop's step is still in
        flight. From chapter 19 the compiles done since are announced first. (From chapter 20, with several
        ranks, every rank gives the same answer: RankScheduler.goes_on.)"""
        # >>> ch19: the grammars compiled since, announced in the inbox (which the ranks share, chapter 20)
        self.grammars.announce()
        # <<< ch19
        return self.busy or last is not None
    # <<< ch06
    # >>> ch19: a scheduler waits a moment for a grammar's compile only when nothing else could run

    def idle(self) -> bool:
        """Nothing is received, queued, running or in flight, but for requests whose grammar compiles."""
        return not (self.inbox or self.waiting or self.running or self.in_flight)
    # <<< ch19

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
        # >>> ch16: the time to first token
        # With first_tokens_first, an iteration that finds a prefill in flight only waits for it and
        # handles it: its first tokens go out before the next launch, not after (a CPU runs a step at
        # its launch: a whole step sooner). The price: the device idles while the host handles the
        # prefill and launches the next step, once per prefill.
        if self.first_tokens_first and last is not None and last.batch.gives_first_tokens:
            self.wait(last)
            return None, self.process(last)
        # <<< ch16
        # >>> ch19: a step the runner builds from the tokens the step in flight accepts: that step is handled first
        # A drafter on the host drafts from the tokens step N accepts: the device idles from the end of
        # step N until N+1 is launched, a wait overlap cannot remove.
        if last is not None and self.runner.waits_for_host(self.running):
            self.wait(last)
            return None, self.process(last)
        # <<< ch19
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
        # >>> ch19: first the grammar queue's part of the inbox
        replies += self.grammars.receive()
        # <<< ch19
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add":
                self.waiting.append(item)
            # >>> ch09 replaces ch04: its reply tells what its caller's output reports of it (describe)
            #| elif (req := self.find(item)) is not None:
            #|     replies.append(self.abort_now(req))
            elif (req := self.find(item)) is not None:
                replies.append(self.describe(req, self.abort_now(req)))
            # <<< ch09
        return replies

    def schedule(self) -> ForwardBatch | None:
        """The step's choice, which a PrefillAdder makes: the waiting requests that fit, admitted, make a
        prefill step; if none does, every running request decodes. From chapter 18 the prompts of a step
        share a budget of tokens: the next chunk of a prompt begun goes first, then the waiting requests
        that fit, each with its first chunk; with mixed_chunk a prefill step carries the decode rows too."""
        # >>> ch08: the checker names the step in its reports
        self.runner.name_step(self.step + 1)
        # <<< ch08
        # >>> ch18 replaces ch04: within the step's budget: the next chunk of a prompt begun, then new requests
        #| adder = PrefillAdder(self.runner, self.running)
        adder = PrefillAdder(self.runner, self.running, self.chunked_prefill_size, self.mixed_chunk)
        # >>> ch21: admission by need
        if self.retraction is not None:
            adder.new_token_ratio = self.retraction.estimate()
        # <<< ch21
        adder.add_chunks()
        # <<< ch18
        new = adder.add_waiting(self.waiting)
        # >>> ch06 replaces ch04: only requests that may take another step (the CPU counts what it launched)
        #| decode = list(self.running)
        decode = [r for r in self.running if r.can_decode]
        # <<< ch06
        mode, reqs = adder.step_kind(decode)
        # >>> ch21: requests taken back if the step's pages run short
        if self.retraction is not None:
            reqs = self.retraction.make_room(reqs, new, decode=mode is ForwardMode.DECODE)
        # <<< ch21
        if not reqs:
            self.check_stalled()
            return None
        self.step += 1
        batch = self.runner.batch(mode, reqs)
        # >>> ch17: the requests whose prefill starts after a cached prefix
        if hits := [r.uid for r in new if r.cached_tokens]:
            self.trace.record("hit", self.step, hits)
        # <<< ch17
        self.trace.record("schedule", self.step, [r.uid for r in reqs])
        return batch

    def launch(self, batch: ForwardBatch) -> StepOutput:
        """Have the runner launch the step. From chapter 06 it stays in flight until it is handled; from
        chapter 08 what the scheduler queues next waits, on the device, for the step's shared reads; from
        chapter 19 a constrained step may launch its forward alone."""
        # >>> ch19 replaces ch04: or its forward alone, its sample put off (GrammarManager.puts_off)
        #| out = self.runner.launch(batch, self.step)
        launch = self.runner.launch_forward if self.grammars.puts_off(batch) else self.runner.launch
        out = launch(batch, self.step)
        # <<< ch19
        # >>> ch06: in flight until it is handled
        self.in_flight.append(out)
        # <<< ch06
        # >>> ch08 fix fence: what the scheduler queues from now on runs after this step's shared reads
        # >>> exercise 08.1: place the fence
        if self.guards.fence:
            self.runner.fence(out)
        # <<< exercise 08.1
        # <<< ch08
        # >>> ch18: the requests whose rows are a chunk of their prompt: no reply follows for them
        if chunked := [r.uid for r, chunk in zip(batch.reqs, batch.chunks()) if chunk]:
            self.trace.record("chunk", self.step, chunked)
        # <<< ch18
        self.trace.record("launch", self.step, [r.uid for r in batch.reqs])
        return out

    def wait(self, out: StepOutput) -> None:
        self.runner.wait(out)
        self.trace.record("wait", out.step, [r.uid for r in out.batch.reqs])

    # ---- abort (the frees: output_processor.py)
    def find(self, uid: int) -> Req | None:
        """The request of that uid that is queued or running; None if it has finished or never came."""
        # >>> ch19 replaces ch04: in the grammar queue too
        #| return next((r for r in [*self.waiting, *self.running] if r.uid == uid), None)
        return next((r for r in [*self.grammars.queue, *self.waiting, *self.running] if r.uid == uid), None)
        # <<< ch19

    def abort_now(self, req: Req) -> Reply:
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
            return Reply(req.uid, [], True, "abort")
        # >>> ch19: or in the grammar queue, holding nothing either
        if self.grammars.drop(req):
            return Reply(req.uid, [], True, "abort")
        # <<< ch19
        # >>> ch07 fix abort-in-flight replaces ch04: a step in flight may hold it: free it as a finish is freed
        #| self.running.remove(req)
        #| self.runner.release(req)
        self.free(req)
        # <<< ch07
        return Reply(req.uid, [], True, "abort")

    def abandon(self) -> None:
        """The run's caller left, or a step failed: abort every request and handle the steps still in
        flight (07), dropping all replies. Nothing stays queued, running or held. (From chapter 20 rank 0
        tells the other ranks to do the same: RankScheduler.abandon.) From chapter 06 on the schedule
        stream, as an iteration is, whoever calls it: its frees write shared tables (from chapter 17 a
        freed row is rewritten, its pages given to the tree), and the next run's writes must follow them
        on the device; a caller's own stream, a GPU's default one, is in no order with the engine's two."""
        # >>> ch06 replaces ch04: on the schedule stream
        #| self.receive()
        #| for req in [*self.waiting, *self.running]:
        #|     self.abort_now(req)
        with self.runner.schedule_stream():
            self.receive()
            for req in [*self.waiting, *self.running]:
                self.abort_now(req)
            # >>> ch19: and those whose grammar compiles
            for req in list(self.grammars.queue):
                self.abort_now(req)
            # <<< ch19
            # >>> ch07: a step in flight is handled: its aborted requests' results are dropped (stale-reply)
            for out in list(self.in_flight):
                self.wait(out)
                self.process(out)
            # <<< ch07
        # <<< ch06

