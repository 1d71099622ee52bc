# >>> ch16 file: the scheduler process
"""The scheduler process: the engine of chapters 01-14, behind two pipes.

The HTTP side (api.py) tokenizes, checks and detokenizes; this process only schedules and steps, as
SGLang's scheduler process does. Messages in: Add, Abort, Integrity, Stop. Messages out: Ready (or
Failed) once, then Accepted or Rejected for every Add, Tokens for every reply, and the integrity report.

The loop receives at the top of every iteration (Scheduler.run's `receive`): a request that arrives
while a step runs waits in the pipe until the step's iteration is over. With nothing to do, the process
blocks on the pipe; the run it starts when something arrives ends when it has nothing left to do.
"""

from __future__ import annotations

import signal
# >>> ch21: what the pool holds, on stderr
import sys
# <<< ch21
from multiprocessing.connection import Connection

from minioverlap.engine.request import Req
from minioverlap.llm import LLM
# >>> ch20: a rank's failure
from minioverlap.ranks import RankFailed
# <<< ch20
from minioverlap.scheduler.checks import IntegrityError
from minioverlap.scheduler.scheduler import Reply
from minioverlap.server.messages import (Abort, Accepted, Add, Failed, Integrity, Ready, Rejected, Report, Stop,
                                         Tokens)


def run_engine(options: dict, inbox: Connection, outbox: Connection, first_tokens_first: bool = False) -> None:
    """The scheduler process's main: build the engine, say Ready, serve until Stop (or the HTTP side is
    gone: its pipe closes). Ctrl-C reaches every process of the terminal: this one leaves the shutdown
    to the HTTP side, which sends Stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = LLM(**options)
    except Exception as err:                 # a bad option or checkpoint: the HTTP side prints it and exits
        outbox.send(Failed(str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"))
        return
    # >>> ch21: what the pool holds, on stderr, as `generate` says it
    print(f"minioverlap: {llm.pool_summary()}", file=sys.stderr, flush=True)
    # <<< ch21
    outbox.send(Ready(llm.max_seq_len))
    # >>> ch20 replaces ch16: a rank that fails or dies ends the engine, and the HTTP side is told why
    #| EngineLoop(llm, inbox, outbox, first_tokens_first).serve()
    try:
        EngineLoop(llm, inbox, outbox, first_tokens_first).serve()
    except RankFailed as err:
        outbox.send(Failed(str(err)))
    llm.shutdown()                           # the other ranks stop with it
    # <<< ch20


class EngineLoop:
    """Runs of the scheduler's loop, one per busy period, fed by the pipe."""

    def __init__(self, llm: LLM, inbox: Connection, outbox: Connection, first_tokens_first: bool = False) -> None:
        self.llm, self.scheduler = llm, llm.scheduler
        self.first_tokens_first = first_tokens_first       # Scheduler.run's option: a prefill handled before the next launch
        self.inbox, self.outbox = inbox, outbox
        self.stopping = False
        self.finishes: dict[str, int] = {}

    def serve(self) -> None:
        while not self.stopping:
            self.take(self.next_message())       # idle: wait for the next message
            if self.scheduler.busy:
                replies = self.scheduler.run(self.llm.args.overlap, self.receive, self.first_tokens_first)
                for reply in replies:
                    self.send(reply)

    def send(self, reply: Reply) -> None:
        """A reply to the HTTP side; a finished request is counted by its finish_reason."""
        self.outbox.send(tokens(reply))
        if reply.finished:
            self.finishes[reply.finish_reason] = self.finishes.get(reply.finish_reason, 0) + 1

    def receive(self) -> bool:
        """The receive step: every message that arrived since the last one, without waiting. False: stop."""
        while not self.stopping and self.inbox.poll():
            self.take(self.next_message())
        return not self.stopping

    def next_message(self) -> object:
        """The HTTP side's next message, waiting for it. From chapter 20 a rank that dies meanwhile ends the
        wait at once: RankFailed."""
        # >>> ch20: an idle server notices a rank's death at once
        if self.llm.ranks is not None:
            self.llm.ranks.wait(self.inbox)
        # <<< ch20
        try:
            return self.inbox.recv()
        except (EOFError, OSError):              # the HTTP side is gone
            return Stop()

    def take(self, msg: object) -> None:
        """Put one message into the scheduler's inbox, or answer it."""
        if isinstance(msg, Add):
            self.add(msg)
        elif isinstance(msg, Abort):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, Integrity):
            self.outbox.send(self.report())
        elif isinstance(msg, Stop):
            self.stopping = True
        else:
            raise TypeError(f"the scheduler process got {msg!r}, not a message it knows")

    def add(self, msg: Add) -> None:
        """The HTTP side has checked the request (Processor.make_request, where an error becomes a 400):
        it is not checked again here, but for what only the scheduler knows, whether it could ever fit
        the page pool. The HTTP side's id becomes its uid."""
        req = Req(msg.rid, msg.prompt_ids, msg.params, msg.max_new_tokens, frozenset(msg.stop_ids),
                  text=self.llm.processor.text_stream(msg.params))      # where its stop strings are found
        try:
            self.scheduler.check_fits_pool(req)
        except ValueError as err:
            self.outbox.send(Rejected(msg.rid, str(err)))
            return
        # >>> ch19: its grammar, compiled in the backend's thread: the request waits in the grammar queue, not this loop
        try:
            req.grammar = self.llm.processor.grammar(req.params)
        except ValueError as err:                      # a model without a tokenizer
            self.outbox.send(Rejected(msg.rid, str(err), req.params.grammar_kind))
            return
        # <<< ch19
        self.scheduler.add_request(req)
        self.outbox.send(Accepted(msg.rid))

    def report(self) -> Report:
        runner, sched = self.scheduler.runner, self.scheduler
        try:
            sched.check_integrity()
            problems = None
        except IntegrityError as err:
            problems = str(err)
        report = Report(not (sched.busy or sched.in_flight or sched.deferred), problems, runner.free_pages,
                        runner.usable_pages, runner.free_rows, self.llm.max_running, dict(self.finishes),
                        self.llm.backend.kernels, len(sched.running), len(sched.waiting) + len(sched.inbox))
        # >>> ch21: the requests taken back
        report.retractions = sched.retraction.count if sched.retraction else 0
        # <<< ch21
        return report


def tokens(reply: Reply) -> Tokens:
    """A reply as the pipe carries it (from chapter 17 with the prompt tokens its request found in the
    prefix cache)."""
    message = Tokens(reply.uid, reply.token_ids, reply.finished, reply.finish_reason, reply.error, logprobs(reply))
    # >>> ch17: the prefix cache
    message.cached_tokens = reply.cached_tokens
    # <<< ch17
    return message


def logprobs(reply: Reply) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """The reply's TokenLogprobs (a request that asked for them), as plain tuples for the pipe."""
    return None if reply.logprobs is None else [(t.logprob, list(t.top)) for t in reply.logprobs]
