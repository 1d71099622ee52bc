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
# >>> ch20: the state every rank's scheduler holds alike, as a checksum
import zlib
from array import array
# <<< ch20
# >>> ch16: a server's requests arrive while the loop runs
from collections.abc import Callable
# <<< ch16
# >>> ch19: grammars compile in a thread of their own
from concurrent import futures
# <<< ch19

# >>> ch08: the guards
from minioverlap.config import Guards
# <<< ch08
from minioverlap.device.trace import Trace
from minioverlap.engine.forward_batch import ForwardBatch
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.scheduler.output_processor import OutputProcessorMixin, Reply
from minioverlap.scheduler.prefill_adder import PrefillAdder


# >>> ch16: a server's run lasts as long as its busy period, for ever under load: its trace keeps the last events
TRACE_EVENTS = 100_000
# <<< ch16
# >>> ch19: an idle scheduler waits this long at most for a grammar's compile, then looks at its inbox again
GRAMMAR_POLL_S = 0.005
# <<< ch19


class IntegrityError(RuntimeError):
    """A page, KV slot or request slot that is lost, or owned twice."""


class Scheduler(OutputProcessorMixin):
    def __init__(self, runner: ModelRunner) -> None:
        """The queues of requests (waiting: not admitted yet; running: holding a slot and pages), the
        steps launched but not handled yet (06), and the trace of the current run."""
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
        # >>> ch19: requests whose grammar compiles (SGLang's grammar_queue), and the compiles watched here
        self.grammar_queue: list[Req] = []    # received; each joins the waiting ones once its grammar is compiled
        self.compiling: list[Req] = []        # submitted here, their compile not yet announced (announce_grammars)
        # <<< ch19
        # >>> ch20: the ranks: every rank's inbox becomes rank 0's before each iteration (None: one rank)
        self.share: Callable[[list], list] | None = None
        self.following = False                  # a rank other than 0: it runs until rank 0 says stop
        self.stopped = False
        self.send_trace: Callable[[], None] | None = None     # a following rank's: its last run's trace to rank 0
        # <<< ch20

    # ---- the client's side: messages into the inbox
    def check_fits_pool(self, req: Req) -> None:
        """Refuse a request that could never fit the page pool, even alone."""
        pages, pool = self.runner.pages_needed(req), self.runner.usable_pages
        if pages > pool:
            raise ValueError(f"{self.runner.need(req)} need {pages} pages; the pool has {pool}")

    def submit(self, reqs: list[Req]) -> None:
        """Queue a run's requests for its first receive."""
        self.inbox.extend(("add", req) for req in reqs)
        # >>> ch19: their grammars' compiles, watched until they are done
        self.compiling += [req for req in reqs if req.grammar is not None]
        # <<< ch19

    def add_request(self, req: Req) -> None:
        """Queue a request for the next receive (a run in progress)."""
        self.inbox.append(("add", req))
        # >>> ch19: its grammar's compile, watched until it is done
        if req.grammar is not None:
            self.compiling.append(req)
        # <<< ch19

    def abort(self, uid: int) -> None:
        self.inbox.append(("abort", uid))

    @property
    def busy(self) -> bool:
        """Whether a request is queued or running."""
        # >>> ch19 replaces ch04: the grammar queue too
        #| return bool(self.inbox or self.waiting or self.running)
        return bool(self.inbox or self.grammar_queue or self.waiting or self.running)
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
        flight. From chapter 19 the compiles done since are announced first; from chapter 20, with several
        ranks, every rank gives the same answer (shared_busy)."""
        # >>> ch19: the grammars compiled since, announced in the inbox (which the ranks share, chapter 20)
        self.announce_grammars()
        # <<< ch19
        # >>> ch20: with several ranks
        if self.share is not None:
            return self.shared_busy(last)
        # <<< ch20
        return self.busy or last is not None
    # <<< ch06
    # >>> ch19: grammars compile in a thread of their own

    def announce_grammars(self) -> None:
        """SGLang's move_ready_grammar_requests, its first half: each request submitted here whose grammar's
        compile is done (or failed) goes into the inbox, ("grammar", uid), after its add. A poll: it never
        waits for a compile, but for a moment (GRAMMAR_POLL_S) when nothing else could run. The receive step
        moves the request (grammar_done): with several ranks after the inbox is shared, so that every rank
        moves it at the same step, rank 0's compile deciding when (chapter 20)."""
        if self.compiling and self.idle():
            futures.wait([r.grammar.compiled for r in self.compiling], GRAMMAR_POLL_S, futures.FIRST_COMPLETED)
        ready = [r for r in self.compiling if r.grammar.ready()]
        self.compiling = [r for r in self.compiling if r not in ready]
        self.inbox.extend(("grammar", r.uid) for r in ready)

    def idle(self) -> bool:
        """Nothing is received, queued, running or in flight, but for requests whose grammar compiles."""
        return not (self.inbox or self.waiting or self.running or self.in_flight)

    def receive_grammars(self) -> list[Reply]:
        """The inbox's part that is the grammar queue's, in order: each request with a grammar joins the queue,
        each ("grammar", uid) moves its request on (grammar_done). The rest stays in the inbox for receive."""
        replies, rest = [], deque()
        for kind, item in self.inbox:
            if kind == "add" and item.grammar is not None:
                self.grammar_queue.append(item)
            elif kind == "grammar":
                replies += self.grammar_done(item)
            else:
                rest.append((kind, item))
        self.inbox = rest
        return replies

    def grammar_done(self, uid: int) -> list[Reply]:
        """SGLang's move_ready_grammar_requests, its second half: the request whose grammar is compiled leaves
        the grammar queue for the waiting ones, with its matcher (on a following rank once its own compile
        is done too: this waits for it), in its place: before those that arrived after it (a higher uid).
        One whose grammar did not compile fails alone, naming its field. A request aborted meanwhile has
        left the queue: nothing to do."""
        req = next((r for r in self.grammar_queue if r.uid == uid), None)
        if req is None:
            return []
        self.grammar_queue.remove(req)
        self.trace.record("grammar", self.step, [uid])
        try:
            req.grammar.start()
        except ValueError as err:
            req.finish_reason, req.error = "error", str(err)
            return [Reply(uid, [], True, "error", req.error)]
        place = next((i for i, r in enumerate(self.waiting) if r.uid > uid), len(self.waiting))
        self.waiting.insert(place, req)
        return []
    # <<< ch19
    # >>> ch20: one scheduler per rank

    def shared_busy(self, last: StepOutput | None) -> bool:
        """Whether the run goes on, the same answer on every rank. First every rank's inbox becomes rank 0's
        (what rank 0's callers sent since the last iteration: requests, aborts), over the CPU group; then
        every rank holds the same requests in the same state and answers alike (busy_anywhere). A following
        rank told to abandon (rank 0's caller left) abandons here too; one told to stop, stops."""
        # >>> exercise 20.2: the agreement before every iteration
        self.inbox = deque(self.share(list(self.inbox)))
        if self.following and ("abandon", None) in self.inbox:
            self.abandon()
            return False
        if self.following and ("traces", None) in self.inbox:
            self.send_trace()
            return False
        self.stopped = ("stop", None) in self.inbox
        self.trace.record("share", self.step + 1, [r.uid for kind, r in self.inbox if kind == "add"])
        return not self.stopped and self.busy_anywhere(last)
        # <<< exercise 20.2

    def busy_anywhere(self, last: StepOutput | None) -> bool:
        """Whether any rank has a request queued or running, or a step in flight. Every rank holds the same
        requests in the same state: this rank's answer is every rank's. (With DP attention each rank holds
        its own, and the ranks ask each other: parallel/dp_scheduler.py.)"""
        return self.busy or last is not None

    def fingerprint(self, inbox: list) -> int:
        """A checksum of what every rank's scheduler must hold alike as an iteration starts: the inbox it is
        about to take (each request's and abort's uid), and each queued and running request's uid, its
        length in the cache and its tokens so far (how many, and the last). Ranks that sampled apart, or
        decided apart, differ here before their next batch is built; the exchange compares it
        (minioverlap/ranks.py). Nothing at all: 0."""
        return checksum(inbox, [*self.grammar_queue, *self.waiting, *self.running])
    # <<< ch20

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
        replies += self.receive_grammars()
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
        adder.add_chunks()
        # <<< ch18
        new = adder.add_waiting(self.waiting)
        # >>> ch06 replaces ch04: only requests that may take another step (the CPU counts what it launched)
        #| decode = list(self.running)
        decode = [r for r in self.running if r.can_decode]
        # <<< ch06
        mode, reqs = adder.step_kind(decode)
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

    def check_stalled(self) -> None:
        """Nothing could be scheduled. If nothing is running either (and, from chapter 06, no step is in
        flight whose handling frees a slot), the waiting requests would wait forever: say so instead."""
        # >>> ch06 replaces ch04: a step in flight will be handled, and may free what they wait for
        #| stalled = self.waiting and not self.running
        stalled = self.waiting and not self.running and not self.in_flight
        # <<< ch06
        if stalled:
            raise RuntimeError(f"the scheduler is stalled: {len(self.waiting)} requests wait, none runs, and "
                               f"{self.runner.free_rows} request slots and {self.runner.free_pages} pages are free")

    def launch(self, batch: ForwardBatch) -> StepOutput:
        """Have the runner launch the step. From chapter 06 it stays in flight until it is handled; from
        chapter 08 what the scheduler queues next waits, on the device, for the step's shared reads; from
        chapter 19 a constrained step may launch its forward alone."""
        # >>> ch19 replaces ch04: or its forward alone (launch_step)
        #| out = self.runner.launch(batch, self.step)
        out = self.launch_step(batch)
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

    # >>> ch19: the sample a constrained step put off

    def launch_step(self, batch: ForwardBatch) -> StepOutput:
        """The runner launches the step; if the step in flight gives a constrained request of it a token, its
        forward alone (with MTP, its passes up to the verify's): that request's mask needs the token, so the
        step's sample (or accept) waits until that step is handled (sample_put_off). A request new to the
        batch, or whose step in flight is a chunk of its prompt, takes no token before this step: its mask
        is ready."""
        given = {r for out in self.in_flight for r in out.batch.reqs if r not in out.batch.chunked}
        if any(r.grammar is not None and r in given for r in batch.reqs):
            return self.runner.launch_forward(batch, self.step)
        return self.runner.launch(batch, self.step)

    def sample_put_off(self) -> None:
        """The step launched after the one just handled, if it put its sample off: its requests' grammars
        have taken every token they will get before it, so its masks can be filled: its sample is queued
        now (`mask`). SGLang's overlap loop does the same: launch_batch_sample_if_needed, after
        process_batch_result, runs the delay_sample_func of a batch with a grammar."""
        for out in self.in_flight:
            if out.sample_later is not None:
                self.runner.sample_later(out)
                self.trace.record("mask", out.step, [r.uid for r in out.batch.reqs])
    # <<< ch19

    def wait(self, out: StepOutput) -> None:
        self.runner.wait(out)
        self.trace.record("wait", out.step, [r.uid for r in out.batch.reqs])

    # ---- abort, frees
    def find(self, uid: int) -> Req | None:
        """The request of that uid that is queued or running; None if it has finished or never came."""
        # >>> ch19 replaces ch04: in the grammar queue too
        #| return next((r for r in [*self.waiting, *self.running] if r.uid == uid), None)
        return next((r for r in [*self.grammar_queue, *self.waiting, *self.running] if r.uid == uid), None)
        # <<< ch19

    # >>> ch07: a request that failed alone

    def fail(self, req: Req) -> Reply:
        """End a request whose step failed for it alone: freed as a finish is, its reply says why."""
        req.finish_reason = "error"
        self.free(req)
        # >>> ch09 replaces ch07: its reply tells what its caller's output reports of it (describe)
        #| return Reply(req.uid, [], True, "error", req.error)
        return self.describe(req, Reply(req.uid, [], True, "error", req.error))
        # <<< ch09
    # <<< ch07

    def abort_now(self, req: Req) -> Reply:
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
            return Reply(req.uid, [], True, "abort")
        # >>> ch19: or in the grammar queue, holding nothing either; its compile no longer watched
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
            self.compiling = [r for r in self.compiling if r is not req]
            return Reply(req.uid, [], True, "abort")
        # <<< ch19
        # >>> ch07 fix abort-in-flight replaces ch04: a step in flight may hold it: free it as a finish is freed
        #| self.running.remove(req)
        #| self.runner.release(req)
        self.free(req)
        # <<< ch07
        return Reply(req.uid, [], True, "abort")

    def free(self, req: Req) -> None:
        """A finished request leaves the running ones, and its pages and request slot go back."""
        # >>> ch07 fix stale-reply removes ch05: launched once more after it finished, it comes back (05-06): free it once
        #| if req not in self.running:
        #|     return
        # <<< ch07
        self.running.remove(req)
        self.release(req)

    def release(self, req: Req) -> None:
        """Give its pages and request slot back (from chapter 07: once no launched step uses them)."""
        # >>> ch07 fix slot-reuse replaces ch04: a launched step still writes its row and pages: keep them until it is handled
        #| self.runner.release(req)
        if self.must_defer():
            self.deferred.append((self.in_flight[-1].step, req))
        else:
            self.runner.release(req)
        # <<< ch07
    # >>> ch07 fix slot-reuse: release what waited

    def must_defer(self) -> bool:
        """Whether a request leaving now must keep its slot and pages until the last launched step is handled."""
        # >>> ch08 replaces ch07: only if asked: the fence and the prefill's own prompt write make release at once safe
        #| return bool(self.in_flight)
        return self.guards.defer_release and bool(self.in_flight)
        # <<< ch08

    def release_deferred(self, handled_step: int) -> None:
        for step, req in [d for d in self.deferred if d[0] <= handled_step]:
            self.deferred.remove((step, req))
            self.runner.release(req)
    # <<< ch07

    def abandon(self) -> None:
        """The run's caller left, or a step failed: abort every request and handle the steps still in
        flight (07), dropping all replies. Nothing stays queued, running or held. From chapter 20 rank 0
        tells the other ranks to do the same, in the inbox they are waiting for."""
        # >>> ch20: the other ranks abandon the run with rank 0
        if self.share is not None and not self.following:
            self.inbox = deque(self.share([*self.inbox, ("abandon", None)]))
        # <<< ch20
        self.receive()
        for req in [*self.waiting, *self.running]:
            self.abort_now(req)
        # >>> ch19: and those whose grammar compiles
        for req in list(self.grammar_queue):
            self.abort_now(req)
        self.compiling.clear()
        # <<< ch19
        # >>> ch07: a step in flight is handled: its aborted requests' results are dropped (stale-reply)
        for out in list(self.in_flight):
            self.wait(out)
            self.process(out)
        # <<< ch07

    def check_integrity(self) -> None:
        """Every page and request slot is free or owned by exactly one running request, and each
        running request's req_to_token row points at its own pages."""
        owners = list(self.running)
        # >>> ch07 fix slot-reuse: deferred requests still own theirs
        owners += [req for _, req in self.deferred]
        # <<< ch07
        problems = self.cache.integrity_problems(owners)
        problems += [f"waiting request {r.uid} holds a slot or pages" for r in self.waiting if r.row or r.pages]
        if problems:
            raise IntegrityError("; ".join(problems))
# >>> ch20: the state every rank's scheduler holds alike, as a checksum


def checksum(inbox: list, reqs: list[Req]) -> int:
    """crc32 of the inbox's uids (each add's, abort's and compiled grammar's) and of each request's uid,
    length in the cache, token count and last token; 0 for nothing at all."""
    state = array("q")
    for kind, item in inbox:
        code = {"add": 1, "abort": 2, "grammar": 3}.get(kind)
        state.extend(() if code is None else (code, item.uid if kind == "add" else item))
    for r in reqs:
        state.extend((r.uid, r.seq_len, len(r.output_ids), r.output_ids[-1] if r.output_ids else -1))
    return zlib.crc32(state.tobytes())
# <<< ch20
