"""The face of the engine: `LLM(...)`, `llm.generate(prompts, params)` and, from chapter 04,
`llm.stream`, `llm.abort` and `llm.check_integrity`.

The names stay the same from chapter 01 on; what serves them changes: one prompt at a time with a
contiguous cache (01), on the paged cache (02), one batch for all prompts (03), the scheduler's loop (04).
What it serves them with, the engine, is built in builder.py.
"""

from __future__ import annotations

from collections.abc import Iterator

from minioverlap.builder import Engine, engine_args
# >>> ch02 removes ch01: chapter 01's path: one prompt at a time, a contiguous cache
#| from minioverlap.reference.contiguous import serve
# <<< ch02
# >>> ch03 removes ch02: chapter 02's path: one prompt at a time, on the paged cache
#| from minioverlap.reference.paged_greedy import serve
# <<< ch03
# >>> ch04 removes ch03: chapter 03's path: one batch of up to max_running prompts at a time
#| from minioverlap.reference.batch_generate import serve
# <<< ch04
from minioverlap.engine.request import Req
from minioverlap.processor import Params, Prompt, RequestOutput
from minioverlap.sampling_params import SamplingParams, integral
# >>> ch04: the scheduler
from minioverlap.device.trace import Trace
from minioverlap.scheduler.scheduler import Reply
# <<< ch04
# >>> ch20: several devices
from minioverlap.parallel.group import TPGroup
from minioverlap.ranks import Ranks
# <<< ch20


class LLM(Engine):
    """Load a checkpoint and generate from prompts (text or token ids)."""

    def __init__(self, model: str = "tiny", **options) -> None:
        """Build the engine (builder.py) that `options` describe: the fields of EngineArgs
        (minioverlap/config.py), each with its default there and the chapter that adds it.

        From chapter 20, with tp_size > 1, this process is rank 0: before it loads anything it starts the
        other ranks (minioverlap/ranks.py), processes that build this same engine over their own shards,
        and joins their group; then it loads its own shard, and its scheduler shares its inbox with theirs
        before every iteration. shutdown() stops them. If another rank fails or dies, rank 0's next
        exchange with it raises RankFailed, with its traceback, and every other rank's process is stopped:
        the engine cannot go on without a shard of every layer."""
        # >>> ch20: the other ranks, started by join_group
        self.ranks: Ranks | None = None
        self.options = options
        # <<< ch20
        super().__init__(engine_args(model, options))
        # >>> ch20: rank 0's scheduler shares its inbox with the other ranks' before every iteration
        if self.ranks is not None:
            self.scheduler.share = lambda items: self.ranks.share(items, self.scheduler.fingerprint)
        # <<< ch20
        self.next_uid = 0
        # >>> ch04: one run at a time
        self.serving = False                     # a stream is being consumed
        self.unstarted: dict[int, bool] = {}     # a stream's requests until its run starts: uid -> aborted
        # <<< ch04

    # >>> ch20: rank 0 starts the other ranks

    def join_group(self) -> TPGroup:
        """With tp_size > 1, before anything is loaded: start the other ranks, each loading its shard, and
        join their group as rank 0."""
        if self.args.tp_size == 1:
            return TPGroup.single()
        self.ranks = Ranks(self.args.model, self.options, self.args.tp_size, self.device, self.args.dist_timeout)
        return self.ranks.group
    # <<< ch20

    def make_requests(self, prompts: Prompt | list[Prompt], params: Params) -> list[Req]:
        """Check every prompt first (Processor.make_requests); only if all pass do they get their uids."""
        reqs = self.processor.make_requests(prompts, params)
        # >>> ch04: a request that could never fit the page pool is refused now, not left waiting forever
        for req in reqs:
            self.scheduler.check_fits_pool(req)
        # <<< ch04
        # >>> ch19: a request with a grammar gets its own, compiling in the backend's thread
        for req in reqs:
            req.grammar = self.processor.grammar(req.params)
        # <<< ch19
        for req in reqs:
            req.uid, self.next_uid = self.next_uid, self.next_uid + 1
        return reqs

    def generate(self, prompts: Prompt | list[Prompt], params: Params = None) -> list[RequestOutput]:
        """Complete every prompt. Every prompt is checked before any runs."""
        reqs = self.make_requests(prompts, params)
        # >>> ch04 replaces ch01: the scheduler's loop, which admits requests as room frees up
        #| serve(self, reqs)                    # chapters 01-03: minioverlap/reference/
        for _ in self._serve(reqs):
            pass
        # <<< ch04
        return [self.processor.output(r) for r in reqs]
    # >>> ch04: the scheduler

    def stream(self, prompts: Prompt | list[Prompt], params: Params = None) -> Iterator[Reply]:
        """Yield replies as the scheduler handles them: r.uid, r.token_ids (the new ones), r.finished.
        The prompts are checked before the first reply (ValueError on a bad one)."""
        reqs = self.make_requests(prompts, params)
        self.unstarted.update((req.uid, False) for req in reqs)
        return self._serve(reqs)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Add one request to a run in progress (a `stream` being consumed); returns its uid.
        A bad request raises ValueError here and changes nothing."""
        if not self.serving:
            raise RuntimeError("add_request adds to a run in progress (a stream being consumed); "
                               "to start a run, call stream(...) or generate(...)")
        [req] = self.make_requests([prompt], params)
        self.scheduler.add_request(req)
        return req.uid

    def abort(self, uid: int) -> None:
        """Stop a request: it frees its pages and slot, and its last reply has finish_reason 'abort'.
        A request that has finished is left as it is; a uid no request has been given is refused."""
        number = integral(uid)
        if number is None:
            raise ValueError(f"uid must be an integer, a request's id, got {uid!r}")
        if not 0 <= number < self.next_uid:
            made = f"have uids 0 to {self.next_uid - 1}" if self.next_uid else "are none"
            raise ValueError(f"uid {number} names no request: the requests made so far {made}")
        if number in self.unstarted:             # its stream has not started: the abort waits with it
            self.unstarted[number] = True
        else:
            self.scheduler.abort(number)

    def _serve(self, reqs: list[Req]) -> Iterator[Reply]:
        """Run the scheduler's loop until every request is done, yielding the replies. The run belongs
        to its caller: if the caller leaves early (break, an exception, close, Ctrl-C) or a step fails,
        every request of the run is aborted and freed, and the engine is as good as new."""
        if self.serving:
            raise RuntimeError("a run is in progress (a stream is being consumed): finish or close it first")
        aborted = [req.uid for req in reqs if self.unstarted.pop(req.uid, False)]
        self.scheduler.submit(reqs)
        for uid in aborted:                      # sent before the run started: they reach it now
            self.scheduler.abort(uid)
        self.serving = True
        # >>> ch06 replaces ch04: the loop the options ask for
        #| replies = self.scheduler.run()
        replies = self.scheduler.run(self.args.overlap)
        # <<< ch06
        try:
            yield from replies
        except BaseException:                    # GeneratorExit (the consumer left) included
            self.scheduler.abandon()
            raise
        finally:
            self.serving = False

    @property
    def trace(self) -> Trace:
        """The event list of the last run."""
        return self.scheduler.trace

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every page and request slot is free or owned exactly once."""
        self.scheduler.check_integrity()
    # <<< ch04

    def shutdown(self) -> None:
        """Nothing to stop: the engine runs in the caller's thread, step by step. From chapter 20 the
        other ranks' processes are stopped."""
        # >>> ch20: the other ranks
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None
        # <<< ch20
    # >>> ch20: each rank's trace

    def rank_traces(self) -> list[Trace]:
        """The trace of the last run on every rank, rank 0's first (one rank: [self.trace]). Between runs."""
        if self.serving:
            raise RuntimeError("rank_traces is asked between runs: a run is in progress (a stream being consumed)")
        return [self.trace] + (self.ranks.traces() if self.ranks is not None else [])
    # <<< ch20
