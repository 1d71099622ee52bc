"""What a caller gives, made into checked requests, and what the caller gets back: prompts (text or
token ids) to token ids, one SamplingParams per prompt, each request's stop rules; a finished request
to its RequestOutput, the tokens decoded to text (vLLM's InputProcessor and OutputProcessor in one).

It knows the tokenizer, the vocabulary and the context, and nothing of the engine: the face (llm.py)
gives the requests their uids once every one has passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
# >>> ch19: a request's grammar
from typing import TYPE_CHECKING
# <<< ch19

from minioverlap.engine.request import Req
from minioverlap.sampling_params import SamplingParams, integral
# >>> ch16: logprobs and stop strings
from minioverlap.engine.logprobs import TokenLogprob
from minioverlap.text import TextStream, find_stop
# <<< ch16
# >>> ch19: a request's grammar (its module imports xgrammar, only where a grammar is first needed)
if TYPE_CHECKING:
    from minioverlap.constrained.grammar import Grammar, GrammarBackend
# <<< ch19

Prompt = str | list[int]
Params = SamplingParams | list[SamplingParams] | None


@dataclass
class RequestOutput:
    uid: int                           # the request's id, in the order the prompts were given
    prompt_token_ids: list[int]
    token_ids: list[int]               # the generated tokens (EOS included if hit)
    text: str                          # the generated tokens decoded (special tokens skipped)
    finish_reason: str | None          # "stop" (EOS or a stop token), "length" (max_tokens or the context),
                                       # "abort", or (chapter 07) "error": the request failed alone
    # >>> ch09: MTP
    verify_steps: int = 0              # target passes that produced the tokens (0 without MTP)
    # <<< ch09
    # >>> ch16: logprobs
    logprobs: list[TokenLogprob] | None = None   # one per token of token_ids, if params.logprobs is not None
    # <<< ch16
    # >>> ch17: the prefix cache
    cached_tokens: int = 0             # prompt tokens whose K and V came from the prefix cache
    # <<< ch17


class Processor:
    """The caller's side of the engine: checks and tokenizes what comes in, decodes what goes out."""

    def __init__(self, tokenizer, model_dir: Path, config, max_seq_len: int) -> None:
        self.tokenizer = tokenizer               # a `tokenizers.Tokenizer`, or None: token-id prompts only
        self.model_dir = model_dir
        self.vocab_size = config.vocab_size
        self.eos_token_ids = set(config.eos_token_ids)
        self.max_seq_len = max_seq_len
        # >>> ch19: the grammar compiler, made at the first request with a grammar
        self.grammars: GrammarBackend | None = None
        # <<< ch19

    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> token ids, checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.model_dir} has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (list, tuple)):
            ids = [_token_id("prompt", t) for t in prompt]
        else:
            raise ValueError(f"prompt must be text or a list of token ids, got {prompt!r}")
        if not ids:
            raise ValueError("prompt is empty: it must hold at least 1 token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_seq_len}, "
                             f"so a prompt may have at most {self.max_seq_len - 1}")
        return ids

    # >>> ch16 replaces ch01: special tokens kept where a request asks (skip_special_tokens=False)
    #| def decode(self, token_ids: list[int]) -> str:
    #|     return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens) if self.tokenizer else ""
    # <<< ch16

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Req:
        """A checked request with its stop rules: EOS unless ignore_eos, max_tokens, the context limit."""
        ids = self.encode(prompt)
        stop = set() if params.ignore_eos else set(self.eos_token_ids)
        # >>> ch04: stop tokens
        bad = [t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
        stop |= set(params.stop_token_ids)
        # <<< ch04
        # >>> ch16 replaces ch01: a request with stop strings decodes its text as it goes, to find them
        #| return Req(-1, ids, params, min(params.max_tokens, self.max_seq_len - len(ids)), frozenset(stop))
        return Req(-1, ids, params, min(params.max_tokens, self.max_seq_len - len(ids)), frozenset(stop),
                   text=self.text_stream(params))
        # <<< ch16
    # >>> ch16: stop strings

    def text_stream(self, params: SamplingParams) -> TextStream | None:
        """The text a request with stop strings decodes as its tokens arrive, where the scheduler looks
        for them (minioverlap/text.py); None without stop strings: no request pays for what it did not ask."""
        if not params.stop:
            return None
        if self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and {self.model_dir} has no tokenizer.json; "
                             f"stop_token_ids take token ids")
        return TextStream(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
    # <<< ch16
    # >>> ch19: a request's grammar

    def grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's grammar (None: it has none), at once: its compile runs in the backend's thread, and
        its matcher is made when the request is admitted. The backend is made at the first grammar, once;
        it compiles each grammar once."""
        if params.grammar_kind is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{params.grammar_kind} needs a tokenizer (the grammar is over token strings) and "
                             f"{self.model_dir} has no tokenizer.json")
        if self.grammars is None:
            from minioverlap.constrained.grammar import GrammarBackend   # xgrammar: see that module
            self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self.grammars.grammar(params.grammar_kind, params.json_schema or params.regex)
    # <<< ch19

    def make_requests(self, prompts: Prompt | list[Prompt], params: Params) -> list[Req]:
        """One checked request per prompt (no uid yet). `params` is one SamplingParams for all prompts
        or a list of one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and not isinstance(prompts[0], (str, list, tuple))):
            prompts = [prompts]                  # one prompt: text, or token ids
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r}")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if not (isinstance(params, list) and all(isinstance(s, SamplingParams) for s in params)):
            raise ValueError(f"params must be a SamplingParams or a list of one per prompt, got {params!r}")
        if len(params) != len(prompts):
            raise ValueError(f"params is a list of {len(params)} SamplingParams for {len(prompts)} prompts")
        return [self.make_request(p, s) for p, s in zip(prompts, params)]

    def output(self, req: Req) -> RequestOutput:
        """What the caller gets for a request: its tokens and their text, and what later chapters add (the
        verify steps of MTP, logprobs, the prompt tokens served from the prefix cache)."""
        out = RequestOutput(req.uid, req.prompt_ids, req.output_ids, self.output_text(req), req.finish_reason)
        # >>> ch09: with MTP, the verify steps too
        out.verify_steps = req.verify_steps
        # <<< ch09
        # >>> ch16: the text cut before the stop string that ended it; the logprobs, if asked
        floor = req.text.floor if req.text is not None else 0   # with min_tokens: the first that ends past it (TextStream)
        out.text = out.text[:find_stop(out.text, req.params.stop, 0, floor)]   # OpenAI leaves it out (token_ids keep it)
        out.logprobs = req.logprobs if req.params.logprobs is not None else None
        # <<< ch16
        # >>> ch17: the prefix cache
        out.cached_tokens = req.cached_tokens
        # <<< ch17
        return out

    def output_text(self, req: Req) -> str:
        """A request's tokens as text, special tokens skipped; from chapter 16 kept if it asks."""
        # >>> ch16 replaces ch01: special tokens kept where the request asks (skip_special_tokens=False)
        #| return self.decode(req.output_ids)
        return self.decode(req.output_ids, req.params.skip_special_tokens)
        # <<< ch16


def _token_id(field: str, value: object) -> int:
    number = integral(value)
    if number is None:
        raise ValueError(f"{field} token id {value!r} is not an integer")
    return number
