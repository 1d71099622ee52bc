# >>> ch19 file: the requests whose grammar compiles
"""The grammar queue: where a request waits while its grammar compiles, in the shape of SGLang's
GrammarManager (python/sglang/srt/constrained/grammar_manager.py), written anew for this engine.

A grammar compiles in a thread of its own (constrained/grammar.py); the scheduler never waits for it.
A request with a grammar goes from the inbox into this queue, not into the waiting ones, so admission
passes it over and the requests behind it run. Each iteration the manager polls the compiles it
watches; a compile that is done (or failed) is announced in the inbox, ("grammar", uid), and the
receive step moves its request to the waiting ones, in its place. The inbox is what the ranks share
(chapter 20), so every rank moves it at the same step, rank 0's compile deciding when.

    watch     a request submitted here: its compile is polled until it is done
    announce  each compile done since, into the inbox (a poll; a moment's wait only when nothing runs)
    receive   the inbox's part that is the queue's: requests with a grammar join it, announced ones leave
    done      the request whose grammar is compiled joins the waiting ones, or fails alone

In the overlap loop a constrained request's next step is launched before the step in flight is handled:
its mask needs that step's token. So such a step launches its forward alone (`puts_off`), and its
sample is queued once that step is handled (`sample_put_off`).
"""

from __future__ import annotations

from concurrent import futures

from minioverlap.engine.request import Req
from minioverlap.scheduler.output_processor import Reply

# an idle scheduler waits this long at most for a grammar's compile, then looks at its inbox again
GRAMMAR_POLL_S = 0.005


class GrammarManager:
    """The scheduler's grammar queue (SGLang's grammar_queue) and the compiles it watches. It reads and
    writes the scheduler's inbox, waiting queue and trace, as SGLang's manager does its scheduler's."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.queue: list[Req] = []        # received; each joins the waiting ones once its grammar is compiled
        self.compiling: list[Req] = []    # submitted here, their compile not yet announced (announce)

    def __len__(self) -> int:
        return len(self.queue)

    def watch(self, req: Req) -> None:
        """A request submitted here: if it has a grammar, its compile is watched until it is done."""
        if req.grammar is not None:
            self.compiling.append(req)

    def announce(self) -> None:
        """SGLang's move_ready_grammar_requests, its first half: each request submitted here whose grammar's
        compile is done (or failed) goes into the inbox, ("grammar", uid), after its add. A poll: it never
        waits for a compile, but for a moment (GRAMMAR_POLL_S) when nothing else could run. The receive step
        moves the request (done): with several ranks after the inbox is shared, so that every rank moves it
        at the same step, rank 0's compile deciding when (chapter 20)."""
        if self.compiling and self.scheduler.idle():
            futures.wait([r.grammar.compiled for r in self.compiling], GRAMMAR_POLL_S, futures.FIRST_COMPLETED)
        ready = [r for r in self.compiling if r.grammar.ready()]
        self.compiling = [r for r in self.compiling if r not in ready]
        self.scheduler.inbox.extend(("grammar", r.uid) for r in ready)

    def receive(self) -> list[Reply]:
        """The inbox's part that is the grammar queue's, in order: each request with a grammar joins the queue,
        each ("grammar", uid) moves its request on (done). The rest stays in the inbox for receive."""
        sched, replies, rest = self.scheduler, [], []
        for kind, item in sched.inbox:
            if kind == "add" and item.grammar is not None:
                self.queue.append(item)
            elif kind == "grammar":
                replies += self.done(item)
            else:
                rest.append((kind, item))
        sched.inbox.clear()
        sched.inbox.extend(rest)
        return replies

    def done(self, uid: int) -> list[Reply]:
        """SGLang's move_ready_grammar_requests, its second half: the request whose grammar is compiled leaves
        the grammar queue for the waiting ones, with its matcher (on a following rank once its own compile
        is done too: this waits for it), in its place: before those that arrived after it (a higher uid).
        One whose grammar did not compile fails alone, naming its field. A request aborted meanwhile has
        left the queue: nothing to do."""
        req, sched = self.find(uid), self.scheduler
        if req is None:
            return []
        self.queue.remove(req)
        sched.trace.record("grammar", sched.step, [uid])
        try:
            req.grammar.start()
        except ValueError as err:
            req.finish_reason, req.error = "error", str(err)
            return [Reply(uid, [], True, "error", req.error)]
        place = next((i for i, r in enumerate(sched.waiting) if r.uid > uid), len(sched.waiting))
        sched.waiting.insert(place, req)
        return []

    def find(self, uid: int) -> Req | None:
        return next((r for r in self.queue if r.uid == uid), None)

    def drop(self, req: Req) -> bool:
        """An aborted request leaves the queue, holding nothing; its compile is no longer watched. Whether
        it was here."""
        if req not in self.queue:
            return False
        self.queue.remove(req)
        self.compiling = [r for r in self.compiling if r is not req]
        return True

    # ---- the sample a constrained step put off

    def puts_off(self, batch) -> bool:
        """Whether the step launches its forward alone (with MTP, its passes up to the verify's): the step in
        flight gives a constrained request of it a token, and that request's mask needs the token, so the
        step's sample (or accept) waits until that step is handled (sample_put_off). A request new to the
        batch, or whose step in flight is a chunk of its prompt, takes no token before this step: its mask
        is ready."""
        given = {r for out in self.scheduler.in_flight for r in out.batch.reqs if r not in out.batch.chunked}
        return any(r.grammar is not None and r in given for r in batch.reqs)

    def sample_put_off(self) -> None:
        """The step launched after the one just handled, if it put its sample off: its requests' grammars
        have taken every token they will get before it, so its masks can be filled: its sample is queued
        now (`mask`). SGLang's overlap loop does the same: launch_batch_sample_if_needed, after
        process_batch_result, runs the delay_sample_func of a batch with a grammar."""
        sched = self.scheduler
        for out in sched.in_flight:
            if out.sample_later is not None:
                sched.runner.sample_later(out)
                sched.trace.record("mask", out.step, [r.uid for r in out.batch.reqs])
