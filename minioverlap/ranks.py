# >>> ch20 file: the ranks of a tensor-parallel engine
"""The ranks of a tensor-parallel engine: one process per device, each with its own scheduler.

`LLM(tp_size=N)` is rank 0. It starts ranks 1..N-1, each a process of its own (pinned to its device on a
GPU) that builds the same engine (builder.py's Engine) over its shard of the weights and runs `follow`: the scheduler's loop,
run after run, for ever. Every rank schedules for itself, as SGLang's and mini-sglang's schedulers do;
they agree because they start equal and, before every iteration, each takes rank 0's inbox (what rank 0's
callers sent: requests and aborts), over the CPU group (RankScheduler.shared_busy). The same inbox, the same
state, the same deterministic decisions: the same batch on every rank, whose all-reduces then line up.
After each exchange the ranks compare fingerprints of what they hold (`parted`): ranks that have parted
end the engine there, before their batches' collectives could pair wrongly.
Only rank 0 has callers, and only rank 0's replies go anywhere.

A request crosses as it is, but for what a process cannot pickle or need not carry: its grammar and its
stop-string decoder, which each rank makes again from the request's params (`shared`, `received`): each
rank compiles the grammar in its own thread, and the request joins the waiting ones when rank 0's compile
is done, announced in the inbox the ranks share (GrammarManager.announce), at the same step on every
rank.

Stopping. `Ranks.shutdown` sends the ranks a stop through the same channel, waits for them, and kills
any that do not end. A rank that fails sends its traceback up its pipe and exits; rank 0's next
collective then fails (its peer is gone) and the LLM raises RankFailed with that traceback, after killing
the other ranks: no process is left. Ranks are daemon processes, so they end with rank 0 in any case.

Idling. Between runs (and in a server, for as long as no request comes) the other ranks wait for rank 0's
next inbox with no deadline: only rank 0 knows when work comes. A rank that dies meanwhile is found at
once by a server (`Ranks.wait`, beside its wait for requests) and by a script at its next run.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from minioverlap.builder import Engine, engine_args
from minioverlap.config import EngineArgs
from minioverlap.engine.request import Req
from minioverlap.model.loader import load_config, resolve_model_dir
from minioverlap.parallel.dp_attention import check_dp_size
from minioverlap.parallel.group import TPGroup, init_group
from minioverlap.parallel.model import check_tp_size

START_TIMEOUT_S = 300.0        # rank 0 waits this long for a rank to load its shard and say it is ready
STOP_TIMEOUT_S = 30.0          # and this long for a rank to end after the stop, before it is killed
STOP = ("stop", None)          # the inbox message that ends a following rank
TRACES = ("traces", None)      # and the one that has it send its last run's trace up its pipe


class RankFailed(RuntimeError):
    """A rank other than 0 failed (its traceback in the message) or died; the engine's ranks are stopped."""


class Ranks:
    """Rank 0's side: the other ranks' processes, a pipe from each, and the group they all joined."""

    def __init__(self, model: str, options: dict, tp_size: int, device: str, timeout_s: float) -> None:
        """Start ranks 1..tp_size-1 (each builds `LLM(model, **options)` over its shard and reports ready),
        and join the group with them as rank 0; a collective waits timeout_s for a peer (dist_timeout)."""
        check_size = check_dp_size if options.get("dp_attention") else check_tp_size
        check_size(load_config(resolve_model_dir(model)), tp_size)           # before any process starts
        ctx = mp.get_context("spawn")
        self.dir = tempfile.TemporaryDirectory(prefix="minioverlap-ranks-")
        init_method = f"file://{os.path.join(self.dir.name, 'rendezvous')}"
        self.procs, self.pipes, self.failed = [], [], None
        for rank in range(1, tp_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=follow, args=(rank, tp_size, init_method, model, options, rank_device(device, rank),
                                                    theirs, timeout_s), daemon=True, name=f"minioverlap-rank-{rank}")
            proc.start()
            self.procs.append(proc)
            self.pipes.append(ours)
        self._kill = weakref.finalize(self, kill, self.procs)     # if rank 0 forgets to shut down
        self.group = self.join(lambda: init_group(0, tp_size, init_method, rank_device(device, 0), timeout_s))
        for rank, pipe in enumerate(self.pipes, start=1):
            self.expect(rank, pipe, "ready")

    def join(self, init: Callable[[], TPGroup]) -> TPGroup:
        """Join the group as rank 0 (`init`, in a thread of its own) while watching the other ranks: one that
        dies before it joins (its process could not start: an import, a device, its arguments) ends the
        start at once, RankFailed naming it, instead of leaving rank 0 waiting JOIN_TIMEOUT_S for it."""
        joined: dict[str, object] = {}

        def joining() -> None:
            try:
                joined["group"] = init()
            except BaseException as e:            # raised below, in the caller's thread
                joined["error"] = e
        thread = threading.Thread(target=joining, daemon=True, name="minioverlap-rank-0-join")
        thread.start()
        while thread.is_alive():
            wait([proc.sentinel for proc in self.procs], timeout=0.1)
            if thread.is_alive() and not all(proc.is_alive() for proc in self.procs):
                self.fail(self.failure(0.0) or "a rank died before it joined the group")
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def expect(self, rank: int, pipe: Connection, what: str) -> None:
        """Wait for a rank's message `what`; its failure (or its death) is RankFailed."""
        if not pipe.poll(START_TIMEOUT_S):
            self.fail(f"rank {rank} sent nothing in {START_TIMEOUT_S:.0f} s")
        kind, self.last = receive(pipe)
        if kind != what:
            self.fail(f"rank {rank} failed before it sent its {what}: {self.last or 'its process died'}")

    def failure(self, wait_s: float = 5.0) -> str | None:
        """What went wrong on the other ranks, if anything did: the first traceback one sent, or the exit
        code of one that died. A rank that failed may still be on its way out when rank 0's collective
        fails: the ranks are given up to wait_s to say why."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, (proc, pipe) in enumerate(zip(self.procs, self.pipes), start=1):
                if pipe.poll():
                    kind, text = receive(pipe)
                    if kind == "error":
                        return f"rank {rank} failed:\n{text}"
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if time.monotonic() > deadline:
                return None if not dead else f"rank {dead[0][0]} died (exit code {dead[0][1]})"
            time.sleep(0.05)

    def fail(self, message: str) -> None:
        """Stop every rank and raise RankFailed. Every later exchange (the abandon that follows, say) raises
        the same: the first failure is the one to tell."""
        kill(self.procs)
        self.failed = message
        raise RankFailed(message) from None

    def share(self, items: list, fingerprint: Callable[[list], int] = lambda inbox: 0) -> list:
        """Rank 0's Scheduler.share: its inbox to every other rank (`shared`), kept as it is here; then the
        ranks compare their schedulers' fingerprints with it (`parted`). If the exchange fails, another rank
        has failed or died: RankFailed says which, and why; if the ranks have parted, RankFailed says so."""
        if self.failed:
            raise RankFailed(self.failed)
        try:
            self.group.broadcast_object(shared(items))
            apart = parted(self.group, fingerprint(items), items)
        except RuntimeError as e:               # gloo: a peer closed its connection, or the collective timed out
            self.fail(self.failure() or f"a collective failed: {e}")
        if apart:
            self.fail(apart)
        return items

    def wait(self, conn: Connection) -> None:
        """Block until conn has something to read, or a rank dies: then RankFailed, at once, naming it. An
        idle server waits here, so that its health says the engine has stopped when it has, not at the next
        request."""
        if self.failed:
            raise RankFailed(self.failed)
        if conn not in wait([conn, *(proc.sentinel for proc in self.procs)]):
            self.fail(self.failure() or "a rank died")

    def traces(self) -> list:
        """Each other rank's trace of its last run, asked for through the inbox channel (between runs)."""
        self.share([TRACES])
        traces = []
        for rank, pipe in enumerate(self.pipes, start=1):
            self.expect(rank, pipe, "trace")
            traces.append(self.last)
        return traces

    def shutdown(self) -> None:
        """Send the stop through the inbox channel, wait for every rank to end, kill the ones that do not."""
        try:
            self.share([STOP])
        except RankFailed:                       # a rank is gone already: the others are stopped
            pass
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
        kill(self.procs)
        self.group.destroy()
        self.dir.cleanup()


def receive(pipe: Connection) -> tuple[str, str]:
    """A rank's message: ("ready", ""), ("error", its traceback), or ("died", "") if its pipe closed."""
    try:
        return pipe.recv()
    except (EOFError, OSError):
        return "died", ""


def kill(procs: list) -> None:
    """End every rank that is still running."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(STOP_TIMEOUT_S)


def rank_device(device: str, rank: int) -> str:
    """The device of a rank: its own GPU (cuda:rank) on CUDA; the CPU on a CPU."""
    return f"cuda:{rank}" if str(device).startswith("cuda") else "cpu"


def follow(rank: int, tp_size: int, init_method: str, model: str, options: dict, device: str, pipe: Connection,
           timeout_s: float) -> None:
    """A rank's main: join the group, build the engine over this rank's shard, say ready, then run the
    scheduler's loop run after run (each starts when rank 0's does: the first shared inbox) until the stop.
    Between runs it waits for rank 0's next inbox without a deadline (`idle`)."""
    try:
        torch.set_num_threads(max(1, torch.get_num_threads() // tp_size))
        group = init_group(rank, tp_size, init_method, device, timeout_s)
        engine = RankEngine(engine_args(model, options | {"device": device}), group)
        pipe.send(("ready", ""))
        scheduler, last = engine.scheduler, [engine.scheduler.trace]

        def share(items: list) -> list:                  # rank 0's inbox, once the ranks have compared
            inbox = received(group.broadcast_object(None, idle=True), engine.processor)
            if apart := parted(group, scheduler.fingerprint(inbox), inbox):
                raise RankFailed(apart)
            return inbox
        scheduler.share = share
        scheduler.following, scheduler.send_trace = True, lambda: pipe.send(("trace", last[0]))
        while not scheduler.stopped:
            for _ in scheduler.run(engine.args.overlap):
                pass
            if len(scheduler.trace):                  # a run that ran steps (not a request for the traces)
                last[0] = scheduler.trace
        group.destroy()
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise


class RankEngine(Engine):
    """The engine of a rank other than 0: built over the group its process has joined; it starts nothing."""

    def __init__(self, args: EngineArgs, group: TPGroup) -> None:
        self.given_group = group
        super().__init__(args)

    def join_group(self) -> TPGroup:
        return self.given_group


def parted(group: TPGroup, fingerprint: int, inbox: list) -> str | None:
    """Whether the ranks' schedulers have parted, asked after every exchange of the inbox: each rank's
    fingerprint of the inbox it takes and of its queued and running requests (RankScheduler.fingerprint)
    goes to every rank, in one all-gather of one integer per rank. That collective pairs whatever the
    ranks hold; the next batch's would not (gloo, given tensors of unlike sizes, aborts the process that
    receives the larger). So every rank learns here, before any collective of the next step, that one
    received, sampled or decided apart.
    None when the ranks agree, or when the inbox ends the run (abandon, stop, traces): then nothing
    held is kept."""
    prints = [f for [f] in group.all_gather_ints([fingerprint])]
    apart = [rank for rank, f in enumerate(prints) if f != prints[0]]
    if not apart or any(kind not in ("add", "abort") for kind, _ in inbox):
        return None
    return (f"rank {apart[0]}'s scheduler has parted from rank 0's: the requests they take or hold differ "
            f"(fingerprints {prints}), so would their next batches; a rank received, sampled or decided otherwise")


def shared(items: list) -> list:
    """Rank 0's inbox as it crosses to the other ranks: each request without what does not pickle (its
    grammar's compile) or need not cross (its stop-string decoder), which each rank makes again. A sampled
    request without a seed is given one first, here on rank 0 (SGLang broadcasts one seed to its ranks at
    start): every rank then draws its tokens from the same generator, not from its process's own, whose
    state rank 0's caller may have moved."""
    for kind, item in items:
        if isinstance(item, Req) and item.params.temperature > 0 and item.params.seed is None:
            item.params = replace(item.params, seed=random.getrandbits(63))
    return [(kind, replace(item, grammar=None, text=None) if isinstance(item, Req) else item) for kind, item in items]


def received(items: list, processor) -> list:
    """The inbox a rank received: each request given its own grammar (its compile starts now, in this
    rank's thread) and decoder, from its params."""
    for kind, item in items:
        if isinstance(item, Req):
            item.grammar, item.text = processor.grammar(item.params), processor.text_stream(item.params)
    return items
