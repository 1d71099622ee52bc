# >>> ch16 file: the HTTP side's end of the pipes
"""The HTTP side's end of the pipes to the scheduler process.

Handlers run on one asyncio event loop; the pipe's reads block, so a thread reads them and hands each
message to the loop, which routes it to the request's queue. Sends are short and come from the loop's
own thread, one at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from multiprocessing.connection import Connection

from minioverlap.engine.request import Req
from minioverlap.server.messages import Abort, Accepted, Add, Failed, Integrity, Ready, Rejected, Report, Stop


class EngineGone(RuntimeError):
    """The scheduler process has exited (a crash, or the server is stopping)."""


class EngineClient:
    def __init__(self, to_engine: Connection, from_engine: Connection) -> None:
        self.to_engine, self.from_engine = to_engine, from_engine
        self.ids = itertools.count(1)
        self.answers: dict[int, asyncio.Future] = {}     # rid -> its Accepted or Rejected, once it comes
        self.streams: dict[int, asyncio.Queue] = {}      # rid -> the queue of its Tokens (one for a request's n)
        self.groups: dict[int, list[int]] = {}           # rid -> the rids of the same HTTP request (its n choices)
        self.reports: list[asyncio.Future] = []          # Integrity asks, answered in order
        self.loop: asyncio.AbstractEventLoop | None = None
        self.alive = False
        self.why = "the engine has stopped"              # what a request gets once the engine is gone

    def wait_ready(self) -> Ready:
        """Block until the engine is built: Ready, or its Failed error as a RuntimeError."""
        try:
            msg = self.from_engine.recv()
        except EOFError:
            raise RuntimeError("the scheduler process exited before it was ready") from None
        if isinstance(msg, Failed):
            raise RuntimeError(msg.error)
        self.alive = True
        return msg

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing the engine's messages to the handlers on `loop`."""
        self.loop = loop
        threading.Thread(target=self.read, name="engine-reader", daemon=True).start()

    def read(self) -> None:
        """The reader thread: every message to the loop, then the pipe's end (the process has exited)."""
        while True:
            try:
                msg = self.from_engine.recv()
            except (EOFError, OSError):
                self.on_loop(self.gone)
                return
            self.on_loop(self.route, msg)

    def on_loop(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                     # the event loop has closed: the server is down
            pass

    def route(self, msg: object) -> None:
        if isinstance(msg, Failed):                      # the engine failed while serving (a rank died)
            self.gone(f"the engine has stopped: {msg.error}")
        elif isinstance(msg, Report):
            if self.reports:
                self.reports.pop(0).set_result(msg)
        elif isinstance(msg, (Accepted, Rejected)):
            if (answer := self.answers.pop(msg.rid, None)) is not None and not answer.done():
                answer.set_result(msg)
        elif (queue := self.streams.get(msg.rid)) is not None:   # a stream that left is dropped
            queue.put_nowait(msg)
            if msg.finished:
                self.forget(msg.rid)

    def forget(self, rid: int) -> None:
        self.streams.pop(rid, None)
        self.groups.pop(rid, None)

    def gone(self, why: str | None = None) -> None:
        """Every request still waiting ends with an error; every later one is refused. why: what failed, if
        the engine said (a Failed message); kept for the health check."""
        self.alive, self.why = False, why or self.why       # a Failed's why outlives the pipe's end after it
        self.end_all(self.why)
        for future in self.reports + list(self.answers.values()):
            if not future.done():
                future.set_exception(EngineGone(self.why))
        self.reports.clear()
        self.answers.clear()

    def end_all(self, why: str = "the server is shutting down") -> None:
        """End every request still open with an error (the engine aborts them: their streams leave)."""
        for queue in set(self.streams.values()):
            queue.put_nowait(EngineGone(why))
        self.streams.clear()
        self.groups.clear()

    def send(self, msg: object) -> None:
        if not self.alive:
            raise EngineGone(self.why)
        try:
            self.to_engine.send(msg)
        except (BrokenPipeError, OSError):
            self.gone()
            raise EngineGone(self.why) from None

    async def add(self, reqs: list[Req]) -> tuple[list[int], asyncio.Queue]:
        """Send checked requests (an HTTP request's n choices); their ids and their one queue of Tokens once
        the engine accepted them all. RequestRejected if it refused one (it could never fit the page pool):
        the others are aborted."""
        rids, queue = [next(self.ids) for _ in reqs], asyncio.Queue()
        answers = [self.loop.create_future() for _ in reqs]
        for rid, req, answer in zip(rids, reqs, answers):
            self.answers[rid], self.streams[rid], self.groups[rid] = answer, queue, rids
            self.send(Add(rid, req.prompt_ids, req.params, req.max_new_tokens, tuple(req.stop_ids)))
        try:
            got = await asyncio.gather(*answers)
        except asyncio.CancelledError:           # the client left before the engine answered
            self.abort_group(rids[0])
            raise
        # >>> ch19 replaces ch16: with the field that refused it
        #| refused = [answer.error for answer in got if isinstance(answer, Rejected)]
        #| if refused:
        #|     self.abort_group(rids[0])
        #|     raise RequestRejected(refused[0])
        refused = [answer for answer in got if isinstance(answer, Rejected)]
        if refused:
            self.abort_group(rids[0])
            raise RequestRejected(refused[0].error, refused[0].field)
        # <<< ch19
        return rids, queue

    def abort(self, rid: int) -> None:
        """Stop a request (its client left, or /abort asked); its last Tokens
        say 'abort'. A request that has ended already is left as it is."""
        if self.alive:
            self.send(Abort(rid))

    def abort_group(self, rid: int) -> None:
        """Stop a request and the other choices of its HTTP request."""
        for each in self.groups.get(rid, [rid]):
            self.abort(each)

    def abort_all(self) -> int:
        rids = list(self.streams)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    async def integrity(self) -> Report:
        future = self.loop.create_future()
        self.reports.append(future)
        self.send(Integrity())
        return await future

    def stop(self) -> None:
        """Tell the scheduler process to abort what is left and exit (once; later calls do nothing)."""
        if self.alive:
            try:
                self.send(Stop())
            except EngineGone:
                pass
            self.alive = False


class RequestRejected(ValueError):
    """The engine refused a request that passed the HTTP side's checks (the page pool)."""
    # >>> ch19: or a grammar it could not compile: `field` names it (SamplingParams' name)

    def __init__(self, error: str, field: str | None = None) -> None:
        super().__init__(error)
        self.field = field
    # <<< ch19
