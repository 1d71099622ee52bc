"""Chapter 07: the replies of the naive result handling against the fixed one, in the overlap loop.

The naive handling is chapter 04's, written for the normal loop: it decides `finished` by the
launched length and handles every request of a step. In the overlap loop the launched length is one
step ahead, and a request that stopped at step N is already in step N+1.

    python examples/ch07_one_step_late.py
"""

from __future__ import annotations

from minioverlap import LLM, SamplingParams
from minioverlap.engine.step import StepOutput
from minioverlap.scheduler.scheduler import Reply, Scheduler


class NaiveScheduler(Scheduler):
    """The fixed scheduler with chapter 04's result handling put back (for this demonstration only)."""

    def process(self, out: StepOutput) -> list[Reply]:
        self.in_flight.remove(out)
        replies = []
        for req, token in zip(out.batch.reqs, out.next_tokens_cpu[:, 0].tolist()):
            req.output_ids.append(token)                       # no check for a request finished earlier
            if token in req.stop_ids or not req.can_decode:    # the launched length: one step ahead
                req.finish_reason = "stop" if token in req.stop_ids else "length"
            if req.finished and req in self.running:
                self.running.remove(req)
                self.runner.release(req)                       # at once, though step N+1 still uses it
            replies.append(Reply(req.uid, [token], req.finished, req.finish_reason))
        return replies


def replies_of(scheduler_class: type[Scheduler], params: SamplingParams) -> list[Reply]:
    llm = LLM(model="tiny", overlap=True)
    llm.scheduler = scheduler_class(llm.runner)
    return list(llm.stream(["def fibonacci(n):"], params))


normal = LLM(model="tiny", overlap=False)
stop = normal.generate(["def fibonacci(n):"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids[3]
cases = {"max_tokens=5": SamplingParams(max_tokens=5, ignore_eos=True),
         f"stop token {stop} (the 4th token)": SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))}
for name, params in cases.items():
    print(f"{name}: what the client receives, reply by reply")
    for label, cls in (("naive", NaiveScheduler), ("fixed", Scheduler)):
        shown = [f"{r.token_ids[0]}{'*' if r.finished else ''}" for r in replies_of(cls, params)]
        print(f"  {label}: {' '.join(shown)}")
    print()
print("* marks the reply with finished=True. Naive: with max_tokens=5 the client stops after 4 tokens")
print("(early-finish); after the stop token it still gets a reply (stale-reply).")
