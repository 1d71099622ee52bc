# >>> ch02 file: a request's slot and pages, as the runner gives them
"""The runner's side of a request's slot and pages: a request is admitted (its slot, from chapter 03 its
generator and its prompt in token_pool) and released through the runner, and admission asks the runner
what a request may need (from chapter 04). The ModelRunner (model_runner.py) takes these methods from this
class; the account itself, which slot and pages each request holds, is the cache manager's
(minioverlap/cache/manager.py). SpecRunner and NgramRunner add what their verify windows may reach.
"""

from __future__ import annotations

from minioverlap.engine.request import Req
# >>> ch03: per-request sampling
from minioverlap.engine.sampler import make_generator
# <<< ch03


class SlotsMixin:
    """The request-slot methods of ModelRunner."""

    def admit(self, req: Req) -> None:
        """Give the request a request slot (the cache manager's); from chapter 03 its own generator if
        seeded, and its prompt in token_pool."""
        self.cache.admit(req)
        # >>> ch03: per-request sampling; the prompt goes into token_pool
        req.generator = make_generator(req, self.device)
        self.write_prompt(req)
        # <<< ch03
    # >>> ch03: the prompt goes into token_pool

    def write_prompt(self, req: Req) -> None:
        """The scheduler writes the prompt into token_pool, on the schedule stream (chapter 03)."""
        # >>> ch08 fix prompt-on-forward-stream replaces ch03: only if asked: by default the prefill writes it, on the forward stream
        #| self.tables.write_tokens(req.row, 0, req.prompt_ids)
        if not self.guards.prompt_on_forward_stream:
            self.tables.write_tokens(req.row, 0, req.prompt_ids)
        # <<< ch08
    # <<< ch03

    def release(self, req: Req) -> None:
        """Give back the request's pages and its request slot (the cache manager's)."""
        self.cache.release(req)
    # >>> ch03: the host writes a token it has read back (before chapter 05 keeps it on the device)

    def write_next_token(self, req: Req, token: int) -> None:
        """The token, sampled and read back by the host, into token_pool: the next step's input."""
        self.tables.write_tokens(req.row, req.seq_len, [token])
    # <<< ch03
    # >>> ch04: what admission asks

    @property
    def free_rows(self) -> int:
        return self.tables.num_free

    @property
    def free_pages(self) -> int:
        """Pages a request may still be given (the cache manager counts them)."""
        return self.cache.available_size

    @property
    def usable_pages(self) -> int:
        return self.allocator.num_pages - 1           # page 0 is never handed out

    def pages_needed(self, req: Req) -> int:
        """Pages for every KV slot the request may hold."""
        return self.allocator.pages_for(self.tokens_needed(req))

    def tokens_needed(self, req: Req) -> int:
        """Its prompt and all but its last new token (the last is sampled, never run)."""
        return len(req.prompt_ids) + req.max_new_tokens - 1

    def need(self, req: Req) -> str:
        """What those pages hold, for the message that refuses a request too large for the pool."""
        return f"prompt + max_tokens = {len(req.prompt_ids) + req.max_new_tokens} tokens"
    # <<< ch04
    # >>> ch21: the pages a step takes

    def step_pages(self, req: Req) -> int:
        """The new pages req's next step takes: its chunk of what it fills, or one decode token (a
        verifying runner: its reservation)."""
        end = req.seq_len + (req.chunk_len() if req.prefilling else 1)
        return self.allocator.pages_for(end) - len(req.pages)
    # <<< ch21
