# >>> ch10 file: the relay
"""The relay: what a speculative step hands the next one, kept on the device, one row per request slot.

SGLang calls it the FutureMap (managers/overlap_utils.py; indexed by request slot since PR #25862).
After each step, for every request of the step, row `slot` holds:

    new_seq_lens  the committed length L' = L + accept_len: where the next window starts
    draft_token   the MTP layer's first draft for position L'+1
    hidden        the MTP hidden state that produced it [hidden], which the next draft pass reads

The fourth thing a step hands on, the bonus token at position L' (the target's own token, certain, not
yet in the KV cache), needs no buffer here: token_pool[slot, L'] holds it since chapter 05, where the
verify writes its accepted tokens. (SGLang, with no token table on the device, keeps it in the
FutureMap's output_tokens_buf.) The next step reads the rows of its slots, on the device; the host
gives it slot numbers only, and learns the accepted tokens later, when it handles the step.
A finished request's row is simply overwritten by the next owner of the slot, whose prefill writes it
first. Slot 0 belongs to no request: padded rows of a batch (CUDA graphs, chapter 13) read and write it.

Every access goes through `publish`, `stash` and `read`, which tell the hazard checker what they touch.
"""

from __future__ import annotations

import torch

from minioverlap.device.hazard import HazardChecker

FIELDS = ("new_seq_lens", "draft_token", "hidden")


class Relay:
    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, device: str | torch.device,
                 hazards: HazardChecker | None = None) -> None:
        self.new_seq_lens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.draft_token = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.hazards = hazards

    def publish(self, slots: torch.Tensor, rows: list[int], new_seq_lens: torch.Tensor) -> None:
        """Right after the verify (or a prefill's sampling): where each request's next window starts.
        `slots` on the device, `rows` the same numbers on the host (for the checker)."""
        self.new_seq_lens[slots] = new_seq_lens
        self.record(rows, ("new_seq_lens",), "write", "the step publishes the new lengths")

    def stash(self, slots: torch.Tensor, rows: list[int], draft: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the draft extend: each request's first draft for its next step, and its hidden state."""
        self.draft_token[slots] = draft
        self.hidden[slots] = hidden
        self.record(rows, ("draft_token", "hidden"), "write", "the draft extend stashes the next drafts' inputs")

    def read(self, slots: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, ...]:
        """The rows of `slots`: new_seq_lens [B], draft_token [B], hidden [B, hidden]."""
        self.record(rows, FIELDS, "read", "the step reads what the previous step left")
        # >>> exercise 10.1: read the rows of a step's slots
        return self.new_seq_lens[slots], self.draft_token[slots], self.hidden[slots]
        # <<< exercise 10.1

    def record(self, rows: list[int], fields: tuple[str, ...], kind: str, site: str) -> None:
        if self.hazards:
            for name in fields:
                self.hazards.access(f"relay.{name}", [(row, 0) for row in rows], kind, site)
