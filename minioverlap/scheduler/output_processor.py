# >>> ch04 file: what the scheduler does with a step's result
"""Processing a step's result on the host: each request's tokens appended, the stop rules applied, the
finished freed, and a reply for each client. The Scheduler (scheduler.py) takes these methods from this
class, as SGLang's Scheduler takes its own from SchedulerOutputProcessorMixin
(managers/scheduler_output_processor_mixin.py): the loop in one file, what it does with a result in
another. They use the scheduler's runner, cache manager, trace and frees.

In the overlap loop (chapter 06) this is where results arrive one step late, and where chapter 07's
four bugs and their fixes live.
"""

from __future__ import annotations

from dataclasses import dataclass

from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
# >>> ch16: logprobs
from minioverlap.engine.logprobs import TokenLogprob
# <<< ch16


@dataclass
class Reply:
    """What a streaming client receives after a step: its new tokens, and whether it is done."""
    uid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    # >>> ch07: why a request failed alone
    error: str | None = None
    # <<< ch07
    # >>> ch16: logprobs
    logprobs: list[TokenLogprob] | None = None   # one per token of token_ids, if the request asked
    # <<< ch16
    # >>> ch09: what the caller's output reports of its request beyond its tokens (OutputProcessorMixin.describe)
    verify_steps: int = 0             # with MTP, the target passes that made its tokens so far
    # <<< ch09
    # >>> ch17: the prefix cache
    cached_tokens: int = 0            # prompt tokens its request found in the prefix cache
    # <<< ch17


class OutputProcessorMixin:
    """The result-handling methods of Scheduler."""

    def process(self, out: StepOutput) -> list[Reply]:
        """Handle each request's token of the step, and reply: handle_tokens gives each request its
        tokens, and the step's trace records what was handled and who was answered."""
        # >>> ch06: the step is done; what waited for it can go
        self.in_flight.remove(out)
        self.trace.record_gpu(out.step, *out.gpu_events)
        # <<< ch06
        # >>> ch07 fix slot-reuse: slots and pages that waited for this step to be handled
        self.release_deferred(out.step)
        # <<< ch07
        replies = [self.handle_tokens(req, tokens, out) for req, tokens in zip(out.batch.reqs, out.token_lists())]
        # >>> ch16: each reply's logprobs: this step's, of exactly the tokens it carries
        for req, reply, logprobs in zip(out.batch.reqs, replies, self.runner.logprob_lists(out)):
            self.add_logprobs(req, reply, logprobs)
        # <<< ch16
        # >>> ch17: a handled prefill's requests join the prefix cache
        # (not one it ended, cached as it was freed, nor one aborted while it ran, dropped whole: only those
        # still running; from chapter 21 not one taken back while it ran either, which holds nothing now)
        for req, end in out.batch.prompt_rows():
            if req in self.running:
                self.cache.cache_req(req, end)
        # <<< ch17
        # >>> ch07 fix stale-reply: no reply for a token that must change nothing
        replies = [r for r in replies if r is not None]
        # <<< ch07
        self.trace.record("process", out.step, [r.uid for r in out.batch.reqs])
        self.trace.record("reply", out.step, [r.uid for r in replies])
        # >>> ch19: the step launched after this one, if it put its sample off for this one's tokens, samples now
        self.grammars.sample_put_off()
        # <<< ch19
        return replies

    def handle_tokens(self, req: Req, tokens: list[int], out: StepOutput) -> Reply | None:
        """A request's tokens of one step, on the host (StepOutput.token_lists: its window, cut to its
        accept length): a window of one, until chapter 09's speculative steps give several. From
        chapter 07 a request whose step failed for it alone ends here, with its error; from chapter 09
        every window goes to handle_window, a plain step's window of one too. From chapter 18 a chunk of a
        prompt makes no reply: the prompt goes on in a later step, and the token sampled after it means nothing."""
        # >>> ch07: its step failed for it alone: it ends here, with its error
        if req.error is not None and not req.finished:
            return self.fail(req)
        # <<< ch07
        # >>> ch18: a chunk: its prompt goes on in a later step; the token sampled after it is no reply
        if req in out.batch.chunked:
            return None
        # <<< ch18
        # >>> ch09 replaces ch04: a window of tokens, handled one by one; its reply tells of the request (describe)
        #| return self.handle(req, tokens[0])
        return self.describe(req, self.handle_window(req, tokens, out))
        # <<< ch09

    def handle(self, req: Req, token: int) -> Reply | None:
        """One request's token: append it, apply the stop rules (a request they end is freed), and
        make its reply. From chapter 07: None for a request that finished in an earlier handle, whose
        token must change nothing (in the overlap loop it was launched once more before it finished)."""
        # >>> exercise 07.1 from ch06: repair the naive result handling
        # >>> ch07 fix stale-reply: finished in an earlier handle, it was launched again; drop the token
        if req.finished:
            return None
        # <<< ch07
        # >>> ch19: its grammar takes the token first; one it forbids fails the request alone
        if req.grammar is not None and not req.grammar.accept(token):
            req.error = f"token {token} breaks its grammar"
            return self.fail(req)
        # <<< ch19
        # >>> exercise 04.2: handle a step's result
        req.output_ids.append(token)
        # >>> ch07 fix early-finish replaces ch04: decide by the tokens actually received
        #| if token in req.stop_ids or not req.can_decode:     # by what was launched: one step ahead in the overlap loop
        #|     req.finish_reason = "stop" if token in req.stop_ids else "length"
        req.finish_reason = req.check_stop()
        # <<< ch07
        if req.finished:
            self.free(req)
        return Reply(req.uid, [token], req.finished, req.finish_reason)
        # <<< exercise 04.2
        # <<< exercise 07.1

    # >>> ch09: with MTP, a window of accepted tokens

    def handle_window(self, req: Req, tokens: list[int], out: StepOutput) -> Reply | None:
        """A request's window of tokens: committed (the runner counts them and the target pass that made
        them), then handled one by one: those after the one that finishes the request change nothing.
        One reply carries them all. A window handled after its request finished (the overlap loop
        launched it once more, chapter 07) commits nothing and replies nothing."""
        # >>> exercise 12.1: finishing inside a window
        # >>> ch21 replaces ch09: a request taken back while the step ran commits nothing: it will fill its tokens again
        #| if not req.finished:
        #|     self.runner.commit(req, tokens, out)
        if req in self.running:
            self.runner.commit(req, tokens, out)
        # <<< ch21
        replies = [r for r in (self.handle(req, t) for t in tokens) if r is not None]
        if not replies:
            return None
        # >>> ch19 replaces ch09: with the error of a token its grammar forbids
        #| return Reply(req.uid, [t for r in replies for t in r.token_ids], replies[-1].finished, replies[-1].finish_reason)
        return Reply(req.uid, [t for r in replies for t in r.token_ids], replies[-1].finished, replies[-1].finish_reason,
                     replies[-1].error)
        # <<< ch19
        # <<< exercise 12.1

    def describe(self, req: Req, reply: Reply | None) -> Reply | None:
        """Write into a request's reply what its caller's output reports beyond the tokens: its verify
        steps so far (from chapter 17, the prompt tokens the prefix cache served). A reply carries them
        because its caller may not hold the request: a server's HTTP side, or rank 0 of DP attention,
        whose request another rank serves."""
        if reply is not None:
            reply.verify_steps = req.verify_steps
            # >>> ch17: the prefix cache
            reply.cached_tokens = req.cached_tokens
            # <<< ch17
        return reply
    # <<< ch09
    # >>> ch16: logprobs

    def add_logprobs(self, req: Req, reply: Reply | None, logprobs: list[TokenLogprob] | None) -> None:
        """The logprobs of a request's window (None if it did not ask), cut as its reply's tokens were cut:
        to the token that finished it (a stop token or string, max_tokens), to none for a step handled
        after it finished (no reply)."""
        if reply is None or logprobs is None:
            return
        reply.logprobs = logprobs[:len(reply.token_ids)]
        req.logprobs += reply.logprobs
    # <<< ch16

    # ---- the frees: a finished or failed request leaves, and its slot and pages go back
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

    def free(self, req: Req) -> None:
        """A finished request leaves the running ones, and its pages and request slot go back. From
        chapter 21 a request taken back while its last step ran (retraction.py) may finish when that step is
        handled, by a stop token: it waits to come back and holds nothing, so it only leaves the queue."""
        # >>> ch07 fix stale-reply removes ch05: launched once more after it finished, it comes back (05-06): free it once
        #| if req not in self.running:
        #|     return
        # <<< ch07
        # >>> ch21: taken back while its last step ran, it holds nothing: it leaves the waiting queue
        if req in self.waiting:
            self.waiting.remove(req)
            return
        # <<< ch21
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
