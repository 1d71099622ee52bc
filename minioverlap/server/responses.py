# >>> ch16 file: the response bodies
"""The response bodies of the two endpoints, and the state of each choice while its tokens come in.

A request with n choices is n requests to the engine; each choice has its own text (a TextStream, which
never sends a stop string or the start of one: the engine ends the request on the token that completes
it) and its own count of tokens. The usage adds up the choices' tokens; the prompt is counted once, as
OpenAI counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minioverlap.server.messages import Tokens
from minioverlap.text import TextStream

Logprob = tuple[int, float, list[tuple[int, float]]]     # a token, its logprob, the top (token, logprob)


@dataclass
class Choice:
    index: int
    rid: int                           # its request in the engine
    text: TextStream                   # its text as the tokens come, cut at a stop string
    tokens: int = 0
    finish_reason: str | None = None   # the engine's, once it has ended the request
    logprobs: list[Logprob] = field(default_factory=list)   # the last message's
    sent: int = 0                      # characters of text given out
    offset: int = 0                    # of them, those before the last message's text
    # >>> ch17: the prefix cache
    cached_tokens: int = 0             # prompt tokens its request found in the prefix cache
    # <<< ch17

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take(self, msg: Tokens) -> str:
        """The text a Tokens message adds, never past a stop string."""
        self.tokens += len(msg.token_ids)
        # >>> ch17: the prefix cache
        self.cached_tokens = msg.cached_tokens
        # <<< ch17
        self.logprobs = [(t, lp, top) for t, (lp, top) in zip(msg.token_ids, msg.logprobs or [])]
        delta = self.text.add(msg.token_ids, finished=msg.finished)
        self.offset, self.sent = self.sent, self.sent + len(delta)
        if msg.finished:
            self.finish_reason = msg.finish_reason
        return delta


class Choices:
    """The n choices of one request, found by their engine ids."""

    def __init__(self, choices: list[Choice]) -> None:
        self.all, self.by_rid = choices, {c.rid: c for c in choices}

    def of(self, msg: Tokens) -> Choice | None:
        """The choice a message is for; None once it has finished."""
        choice = self.by_rid.get(msg.rid)
        return None if choice is None or choice.finished else choice

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.all)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.all)
    # >>> ch17: the prefix cache

    @property
    def cached_tokens(self) -> int:
        """The prompt's tokens served from the prefix cache, counted once, as its first choice's."""
        return self.all[0].cached_tokens
    # <<< ch17

    def running(self) -> list[int]:
        """The engine ids still running there: to abort when the client leaves."""
        return [c.rid for c in self.all if not c.finished]


class Shape:
    """The response bodies of one endpoint for one request."""
    object = prefix = ""
    first_chunk = False

    def __init__(self, model: str, token_text: Callable[[int], str], logprobs: int | None = None) -> None:
        self.model, self.created = model, int(time.time())
        self.token_text, self.want_logprobs = token_text, logprobs
        self.rid, self.prompt_tokens = 0, 0

    def head(self, object_name: str) -> dict:
        return {"id": f"{self.prefix}-{self.rid}", "object": object_name, "created": self.created, "model": self.model}

    # >>> ch17 replaces ch16: the choices' usage, with the prompt tokens served from the prefix cache (OpenAI's field)
    #| def usage(self, tokens: int) -> dict:
    #|     return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
    #|             "total_tokens": self.prompt_tokens + tokens}
    #|
    #| def usage_chunk(self, tokens: int) -> dict:
    #|     return self.head(self.object + ".chunk" if self.first_chunk else self.object) | {
    #|         "choices": [], "usage": self.usage(tokens)}
    def usage(self, choices: Choices) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": choices.tokens,
                "total_tokens": self.prompt_tokens + choices.tokens,
                "prompt_tokens_details": {"cached_tokens": choices.cached_tokens}}

    def usage_chunk(self, choices: Choices) -> dict:
        return self.head(self.object + ".chunk" if self.first_chunk else self.object) | {
            "choices": [], "usage": self.usage(choices)}
    # <<< ch17

    def logprobs(self, entries: list[Logprob], offset: int = 0) -> dict | None:
        return None if self.want_logprobs is None else self.format_logprobs(entries, offset)


class Completion(Shape):
    object, prefix = "text_completion", "cmpl"

    def chunk(self, choice: Choice, text: str) -> dict:
        return self.head(self.object) | {"choices": [self.choice(choice, text, choice.logprobs, choice.offset)]}

    def choice(self, choice: Choice, text: str, logprobs: list[Logprob], offset: int = 0) -> dict:
        return {"index": choice.index, "text": text, "logprobs": self.logprobs(logprobs, offset),
                "finish_reason": choice.finish_reason}

    # >>> ch17 replaces ch16: the choices' usage
    #| def full(self, choices: list[tuple[Choice, str, list[Logprob]]], tokens: int) -> dict:
    #|     return self.head(self.object) | {"choices": [self.choice(*c) for c in choices], "usage": self.usage(tokens)}
    def full(self, choices: list[tuple[Choice, str, list[Logprob]]], usage: Choices) -> dict:
        return self.head(self.object) | {"choices": [self.choice(*c) for c in choices], "usage": self.usage(usage)}
    # <<< ch17

    def format_logprobs(self, entries: list[Logprob], offset: int) -> dict:
        """The legacy API's: the tokens as text, their logprobs, the top ones as {text: logprob}, offsets."""
        texts = [self.token_text(t) for t, _, _ in entries]
        offsets = [offset + sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        top = [{self.token_text(t): lp for t, lp in alts} if self.want_logprobs else None for _, _, alts in entries]
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": top,
                "text_offset": offsets}


class Chat(Shape):
    object, prefix = "chat.completion", "chatcmpl"
    first_chunk = True                           # the first chunk of each choice names the role

    def role_chunk(self, choice: Choice) -> dict:
        return self.head(self.object + ".chunk") | {"choices": [
            {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    def chunk(self, choice: Choice, text: str) -> dict:
        return self.head(self.object + ".chunk") | {"choices": [
            {"index": choice.index, "delta": {"content": text} if text else {},
             "logprobs": self.logprobs(choice.logprobs), "finish_reason": choice.finish_reason}]}

    # >>> ch17 replaces ch16: the choices' usage
    #| def full(self, choices: list[tuple[Choice, str, list[Logprob]]], tokens: int) -> dict:
    #|     return self.head(self.object) | {"choices": [
    #|         {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(lps),
    #|          "finish_reason": c.finish_reason} for c, text, lps in choices], "usage": self.usage(tokens)}
    def full(self, choices: list[tuple[Choice, str, list[Logprob]]], usage: Choices) -> dict:
        return self.head(self.object) | {"choices": [
            {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(lps),
             "finish_reason": c.finish_reason} for c, text, lps in choices], "usage": self.usage(usage)}
    # <<< ch17

    def format_logprobs(self, entries: list[Logprob], offset: int = 0) -> dict:
        """Chat's: each token with its logprob, its UTF-8 bytes and its top alternatives."""
        def one(t: int, lp: float) -> dict:
            text = self.token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}
        return {"content": [one(t, lp) | {"top_logprobs": [one(a, alp) for a, alp in alts]} for t, lp, alts in entries]}
