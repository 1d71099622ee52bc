# >>> ch09 file: what every runner that verifies windows of drafts counts alike
"""A runner whose decode step verifies, for each request, a window of k drafts and the token before them:
the MTP drafter's (SpecRunner, runner.py) and, from chapter 19, the n-gram drafter's (NgramRunner,
ngram.py). They draft differently; what they count alike lives here: the request tables and the pages a
request may need are as much wider as its windows may reach past its last token (window_slack), and a
handled verify commits its accepted tokens. SGLang's speculative workers share the same accounting (the
scheduler reserves a request's `num_draft_tokens` slots whatever drafts them).
"""

from __future__ import annotations

from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.request import Req
from minioverlap.engine.step import StepOutput
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.speculative.verify_batch import window_slack
# >>> ch21: the pages a verify step takes
from minioverlap.speculative.verify_batch import reservation_end
# <<< ch21


class VerifyRunner(ModelRunner):
    """The model runner whose every decode step is a verify step of window k+1 (k = draft_steps)."""

    def __init__(self, model: Qwen3ForCausalLM, draft_steps: int, *, max_seq_len: int, **sizes) -> None:
        """Draft draft_steps tokens a step. A request's windows reach past its last token (window_slack), so
        the request tables are that much wider."""
        self.draft_steps = draft_steps
        super().__init__(model, max_seq_len=max_seq_len + window_slack(draft_steps), **sizes)

    def commit(self, req: Req, tokens: list[int], out: StepOutput) -> None:
        """A handled step's tokens for req: one more target pass, and a verify's accepted tokens are
        committed: their KV is in the cache, and the next window starts after them."""
        req.verify_steps += 1
        if out.batch.mode is ForwardMode.TARGET_VERIFY:
            req.seq_len += len(tokens)

    def tokens_needed(self, req: Req) -> int:
        """The plain runner's count, and the KV slots the verify windows may reach past the last token."""
        return super().tokens_needed(req) + window_slack(self.draft_steps)

    def need(self, req: Req) -> str:
        return f"{super().need(req)}, and the {window_slack(self.draft_steps)} KV slots that verify windows may reach past the last one,"
    # >>> ch21: the pages a verify step takes: its reservation

    def step_pages(self, req: Req) -> int:
        """A prefill's as the plain runner counts them; a verify's: its reservation (reserve_kv)."""
        if req.prefilling:
            return super().step_pages(req)
        end = reservation_end(req.seq_len, req.kv_len, self.draft_steps + 1)
        return self.allocator.pages_for(end) - len(req.pages)
    # <<< ch21
