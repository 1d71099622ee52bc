# >>> ch16 file: the response bodies
"""The response bodies of the two endpoints, and the state of each choice while its tokens come in.

The bodies are pydantic models, OpenAI's shapes (FastAPI lists them in /openapi.json and serializes them);
a stream's chunks are the same models, each sent as one server-sent event. Every response has an id of
its own, `cmpl-` or `chatcmpl-` and a random uuid4 in hex, unique across the server's starts, as OpenAI's.

A request with n choices is n requests to the engine; each choice has its own text (a TextStream, which
never sends a stop string or the start of one: the engine ends the request on the token that completes
it) and its own count of tokens. The usage adds up the choices' tokens; the prompt is counted once, as
OpenAI counts it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from minioverlap.server.messages import Tokens
from minioverlap.server.metrics import Meter
from minioverlap.text import TextStream


# ---- the bodies, as OpenAI writes them
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "minioverlap"
    max_model_len: int                 # vLLM's and SGLang's: the context the server serves


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
# >>> ch17: the prompt tokens served from the prefix cache (OpenAI's field)


class PromptTokensDetails(BaseModel):
    cached_tokens: int
# <<< ch17


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # >>> ch17: the prompt tokens served from the prefix cache (OpenAI's field)
    prompt_tokens_details: PromptTokensDetails | None = None
    # <<< ch17


class Head(BaseModel):
    id: str                            # cmpl-<uuid4 hex> (chatcmpl- for chat), the same in every chunk
    object: str
    created: int
    model: str


class UsageChunk(Head):
    """A stream's last chunk before [DONE] when stream_options.include_usage: no choices, the usage."""
    choices: list = []
    usage: Usage


class CompletionLogprobs(BaseModel):
    """The legacy API's: the tokens as text, their logprobs, the top ones as {text: logprob}, offsets."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None          # stop, length, abort; None until the choice ends (a stream's chunks)


class CompletionChunk(Head):
    choices: list[CompletionChoice]


class CompletionResponse(CompletionChunk):
    usage: Usage


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]                   # the token's text in UTF-8


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Head):
    choices: list[ChatChoice]
    usage: Usage


class ChatDeltaChoice(BaseModel):
    index: int
    delta: dict[str, str]              # {"role": "assistant", "content": ""} first, then {"content": text} or {}
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Head):
    choices: list[ChatDeltaChoice]


# ---- each choice while its tokens come in

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
    meter: Meter | None = None         # its request's times and token counts, for /metrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take(self, msg: Tokens) -> str:
        """The text a Tokens message adds, never past a stop string."""
        self.tokens += len(msg.token_ids)
        if self.meter is not None:
            self.meter.took(self.index, msg)
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
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"       # unique, as OpenAI's: /abort maps it to the engine's
        self.token_text, self.want_logprobs = token_text, logprobs
        self.prompt_tokens = 0

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def usage(self, choices: Choices) -> Usage:
        tokens = choices.tokens
        usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=tokens, total_tokens=self.prompt_tokens + tokens)
        # >>> ch17: the prompt tokens served from the prefix cache (OpenAI's field)
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=choices.cached_tokens)
        # <<< ch17
        return usage

    def usage_chunk(self, choices: Choices) -> UsageChunk:
        return UsageChunk(**self.head(self.object + ".chunk" if self.first_chunk else self.object),
                          usage=self.usage(choices))


class Completion(Shape):
    object, prefix = "text_completion", "cmpl"

    def chunk(self, choice: Choice, text: str) -> CompletionChunk:
        return CompletionChunk(**self.head(self.object),
                               choices=[self.choice(choice, text, choice.logprobs, choice.offset)])

    def choice(self, choice: Choice, text: str, logprobs: list[Logprob], offset: int = 0) -> CompletionChoice:
        return CompletionChoice(index=choice.index, text=text, logprobs=self.logprobs(logprobs, offset),
                                finish_reason=choice.finish_reason)

    def full(self, choices: list[tuple[Choice, str, list[Logprob]]], usage: Choices) -> CompletionResponse:
        return CompletionResponse(**self.head(self.object), choices=[self.choice(*c) for c in choices],
                                  usage=self.usage(usage))

    def logprobs(self, entries: list[Logprob], offset: int = 0) -> CompletionLogprobs | None:
        """The legacy API's: the tokens as text, their logprobs, the top ones as {text: logprob}, offsets."""
        if self.want_logprobs is None:
            return None
        texts = [self.token_text(t) for t, _, _ in entries]
        offsets = [offset + sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        top = [{self.token_text(t): lp for t, lp in alts} if self.want_logprobs else None for _, _, alts in entries]
        return CompletionLogprobs(tokens=texts, token_logprobs=[lp for _, lp, _ in entries], top_logprobs=top,
                                  text_offset=offsets)


class Chat(Shape):
    object, prefix = "chat.completion", "chatcmpl"
    first_chunk = True                           # the first chunk of each choice names the role

    def role_chunk(self, choice: Choice) -> ChatCompletionChunk:
        return self.delta(choice, {"role": "assistant", "content": ""}, None, None)

    def chunk(self, choice: Choice, text: str) -> ChatCompletionChunk:
        return self.delta(choice, {"content": text} if text else {}, self.logprobs(choice.logprobs),
                          choice.finish_reason)

    def delta(self, choice: Choice, delta: dict[str, str], logprobs: ChatLogprobs | None,
              finish_reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head(self.object + ".chunk"), choices=[
            ChatDeltaChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])

    def full(self, choices: list[tuple[Choice, str, list[Logprob]]], usage: Choices) -> ChatCompletionResponse:
        return ChatCompletionResponse(**self.head(self.object), usage=self.usage(usage), choices=[
            ChatChoice(index=c.index, message=ChatMessage(content=text), logprobs=self.logprobs(lps),
                       finish_reason=c.finish_reason) for c, text, lps in choices])

    def logprobs(self, entries: list[Logprob]) -> ChatLogprobs | None:
        """Chat's: each token with its logprob, its UTF-8 bytes and its top alternatives."""
        if self.want_logprobs is None:
            return None

        def one(t: int, lp: float) -> dict:
            text = self.token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}
        return ChatLogprobs(content=[ChatTokenLogprob(**one(t, lp), top_logprobs=[one(a, alp) for a, alp in alts])
                                     for t, lp, alts in entries])
