"""A request: its prompt, how it wants its tokens, what it has received, and when it is done."""

from __future__ import annotations

from dataclasses import dataclass, field
# >>> ch19: a request's grammar (its module imports xgrammar, only where a grammar is first needed)
from typing import TYPE_CHECKING
# <<< ch19

# >>> ch03: per-request sampling
import torch
# <<< ch03

from minioverlap.sampling_params import SamplingParams
# >>> ch17: the prefix cache
from minioverlap.cache.radix import Node
# <<< ch17
# >>> ch16: logprobs and stop strings
from minioverlap.engine.logprobs import TokenLogprob
from minioverlap.text import TextStream
# <<< ch16
# >>> ch19: a request's grammar
if TYPE_CHECKING:
    from minioverlap.constrained.grammar import Grammar
# <<< ch19


@dataclass(eq=False)
class Req:
    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int                 # max_tokens, or fewer where the context ends first
    stop_ids: frozenset[int] = frozenset()   # tokens that end it (EOS unless ignore_eos)
    output_ids: list[int] = field(default_factory=list)   # generated tokens the host has received
    # >>> ch02: its place in the paged cache
    row: int = 0                        # request slot: its row in req_to_token (0: none)
    pages: list[int] = field(default_factory=list)   # the pages holding its K/V, in order
    seq_len: int = 0                    # tokens whose K/V are in the cache once the launched steps run
    # <<< ch02
    # >>> ch17: the prefix cache
    cached_len: int = 0                 # its first tokens whose pages the prefix cache holds (pages[:cached_len // page_size])
    last_node: Node | None = None       # the tree node where they end, locked while it runs
    cached_tokens: int = 0              # prompt tokens served from the cache at admission
    # <<< ch17
    # >>> ch18: chunked prefill
    extend_input_len: int | None = None   # prompt tokens its next prefill step runs (its chunk); None: the rest
    # <<< ch18
    # >>> ch03: per-request sampling
    generator: torch.Generator | None = None   # its own random stream when params.seed is set
    # <<< ch03
    finish_reason: str | None = None    # "stop", "length" or "abort" once it is done ("error": chapter 07)
    # >>> ch07: a request whose step failed for it alone
    error: str | None = None            # what failed; it ends with finish_reason "error" when its step is handled
    # <<< ch07
    # >>> ch09: MTP: the passes that produced its tokens, the KV slots reserved ahead, the next drafts' inputs
    verify_steps: int = 0               # target passes that produced its tokens (0 without MTP)
    kv_len: int = 0                     # positions with a KV slot in req_to_token (with MTP beyond seq_len)
    # >>> ch10 removes ch09: the relay holds them, in the request slot's row
    #| draft: tuple[torch.Tensor, torch.Tensor] | None = None   # next first draft token, MTP hidden state: on the device
    # <<< ch10
    # <<< ch09
    # >>> ch16: logprobs and stop strings
    logprobs: list[TokenLogprob] = field(default_factory=list)   # of output_ids, if params.logprobs is not None
    text: TextStream | None = None      # its output as text, searched for params.stop (None: no stop strings)
    prompt_seen: torch.Tensor | None = None   # repetition_penalty: its prompt's tokens, a [vocab] mask on the device
    # <<< ch16
    # >>> ch19: its grammar, advanced by every token it takes (None: a free request)
    grammar: Grammar | None = None
    # <<< ch19
    # >>> ch21: retraction: its prefill lays out again what it had received when it was taken back
    recomputed: int = 0                 # its output tokens that its next prefill runs again (0: none)
    retractions: int = 0                # times it was taken back
    # <<< ch21

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_stop(self) -> str | None:
        """The stop rules, applied to the tokens received: one of stop_ids -> "stop"; max_tokens or the
        end of the context -> "length"."""
        if self.output_ids and self.output_ids[-1] in self.stop_ids:
            return "stop"
        # >>> ch16: a stop string in the text of the tokens received, the newest one's included
        if self.text is not None and self.text.holds_stop(self.output_ids):
            return "stop"
        # <<< ch16
        # >>> ch19: its grammar ended: it took a stop token where the grammar may end (ignore_eos or not)
        if self.grammar is not None and self.grammar.is_terminated():
            return "stop"
        # <<< ch19
        return "length" if len(self.output_ids) >= self.max_new_tokens else None
    # >>> ch04: what the CPU knows at launch

    @property
    def can_decode(self) -> bool:
        """Whether another step may be launched for it, judged by the CPU's count of its length (seq_len),
        not by the tokens received: in the overlap loop those lag one step behind the steps launched.
        From chapter 18 a request whose prompt is not all laid out (chunked) takes no decode step yet."""
        # >>> ch18 replaces ch04: its prompt laid out first
        #| return self.seq_len - len(self.prompt_ids) + 1 < self.max_new_tokens
        return not self.prefilling and self.seq_len - len(self.prompt_ids) + 1 < self.max_new_tokens
        # <<< ch18
    # <<< ch04
    # >>> ch18: chunked prefill

    @property
    def prefilling(self) -> bool:
        """Whether some of its prompt is not laid out in a step yet (once admitted: between its chunks).
        From chapter 21 its prompt is what it fills (fill_ids): after a retraction, its outputs too."""
        # >>> ch21 replaces ch18: the tokens it fills
        #| return self.seq_len < len(self.prompt_ids)
        return self.seq_len < self.fill_len
        # <<< ch21

    def chunk_len(self) -> int:
        """The prompt tokens its next prefill step runs: the chunk the scheduler gave it, or the rest."""
        # >>> ch21 replaces ch18: the rest of what it fills
        #| rest = len(self.prompt_ids) - self.seq_len
        rest = self.fill_len - self.seq_len
        # <<< ch21
        return rest if self.extend_input_len is None else self.extend_input_len

    def prompt_token(self, pos: int) -> int:
        """The prompt token at position pos (the next chunk's first), or -1 past the prompt."""
        # >>> ch21 replaces ch18: what it fills
        #| return self.prompt_ids[pos] if pos < len(self.prompt_ids) else -1
        return self.fill_ids[pos] if pos < self.fill_len else -1
        # <<< ch21
    # <<< ch18
    # >>> ch21: what a prefill lays out

    @property
    def fill_ids(self) -> list[int]:
        """The tokens its prefill lays out: its prompt, and after a retraction the output tokens it had
        received too (SGLang's fill_ids), recomputed; the token sampled after them is its next."""
        return self.prompt_ids + self.output_ids[:self.recomputed]

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building the list: asked of every request, every step."""
        return len(self.prompt_ids) + self.recomputed
    # <<< ch21
