# >>> ch18 file: a step's budget of prompt tokens
"""TokenBudget: how many prompt tokens one step may run, SGLang's `rem_chunk_tokens` (its PrefillAdder,
managers/schedule_policy.py) and vLLM's `max_num_batched_tokens`.

The step's prefill adder (prefill_adder.py) makes it and hands it out in order: first to the request whose
prompt is partly prefilled (its next chunk), then to the waiting requests it admits. Each takes the rest of its prompt, or what is left
of the budget: a prompt longer than that is prefilled over several steps, in chunks. A mixed step's decode
rows are tokens of the step too, so they are spent before any prompt: a step runs at most `size` tokens
(or only its decode rows, where they alone are more).
"""

from __future__ import annotations

from minioverlap.engine.request import Req


class TokenBudget:
    def __init__(self, size: int | None, decode_rows: int = 0) -> None:
        """size: the step's tokens (None: no budget, every prompt runs whole); decode_rows: the tokens that
        a mixed step's decode rows take from it first."""
        self.left = None if size is None else size - decode_rows

    @property
    def spent(self) -> bool:
        """Nothing is left for a prompt: no more requests join this step."""
        return self.left is not None and self.left <= 0

    def take(self, req: Req) -> None:
        """Give req its chunk (req.extend_input_len): the rest of its prompt past what is laid out (its
        cached prefix included), or what is left of the budget if that is less."""
        # >>> exercise 18.1: the chunk budget
        # >>> ch21 replaces ch18: what it fills, its outputs too after a retraction
        #| rest = len(req.prompt_ids) - req.seq_len
        rest = req.fill_len - req.seq_len
        # <<< ch21
        req.extend_input_len = rest if self.left is None else min(rest, self.left)
        if self.left is not None:
            self.left -= req.extend_input_len
        # <<< exercise 18.1
