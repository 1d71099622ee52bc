# >>> ch16 file: the OpenAI request bodies, as pydantic models
"""The bodies of /v1/completions and /v1/chat/completions as pydantic models, and OpenAI's error body
for one that is wrong: `{"error": {"message", "type", "param", "code"}}`, status 400 (404 for a model the
server does not serve).

The routes take these models as their parameters, so FastAPI validates each body against its model and
lists every field in /openapi.json. pydantic does the checking: every field's type (strict: "5" is not an
integer, true is not a number), its range, an unknown field (extra="forbid", OpenAI's "Unrecognized
request argument supplied"). What it reports (a list of errors, each with the field's path, the value and
the broken rule; FastAPI raises them as RequestValidationError, which would be a 422) becomes one OpenAI
error naming the field, status 400, as OpenAI, vLLM and SGLang answer (`api_error`). The JSON itself is
parsed by pydantic's Rust parser (guards.JSONRoute), which refuses what Python's json module lets through
to crash later: a lone surrogate ("\\ud800", text no tokenizer can encode) and nesting deeper than 200.

A field the engine does not implement is refused, not ignored: penalties, logit_bias, tools, echo, suffix
and best_of > 1 would otherwise be silently dropped. The fields beyond OpenAI's (`top_k`, `ignore_eos`,
`stop_token_ids`, `min_p`, `repetition_penalty`, `min_tokens`, `skip_special_tokens`) are vLLM's and
SGLang's names, which their clients send.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError, from_json

from minioverlap.processor import Prompt
from minioverlap.sampling_params import SamplingParams

MAX_N = 16                   # choices per request (each is a request to the engine)
MAX_STOP = 4                 # stop strings per request: OpenAI's limit


class ErrorInfo(BaseModel):
    message: str
    type: str                          # invalid_request_error (a 4xx), server_error (a 5xx)
    param: str | None                  # the field that is wrong, dotted: messages[0].role
    code: str | None                   # what is wrong with it: invalid_value, missing_required_parameter...


class ErrorResponse(BaseModel):
    """OpenAI's error body, the same for every error the server answers."""
    error: ErrorInfo


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.response().model_dump()


# ---- custom rules: each raises PydanticCustomError(code, rule); api_error writes "<field> must be <rule>, got <value>"
def rule(code: str, text: str) -> PydanticCustomError:
    return PydanticCustomError(code, text)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_rule(value: object) -> Prompt:
    if isinstance(value, str) or (isinstance(value, list) and all(is_int(t) for t in value)):
        return value
    raise rule("invalid_type", "text or a list of token ids (one prompt per request: a list of prompts is not supported)")


def stop_rule(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise rule("invalid_type", f"a string or a list of up to {MAX_STOP} strings")
    if len(stops) > MAX_STOP:
        raise rule("invalid_value", f"at most {MAX_STOP} strings")
    if "" in stops:                                          # it would match before the first token (vLLM refuses it too)
        raise rule("invalid_value", "non-empty strings (an empty one would end the text before it starts)")
    return tuple(stops)


def content_rule(value: object) -> str:
    """Text, or a list of text parts (joined): what the chat template takes."""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in value):
        return "".join(p["text"] for p in value)
    if isinstance(value, str):
        return value
    raise rule("invalid_type", "text or a list of text parts")


# Fields OpenAI has and this engine does not implement: name -> the values that mean "not asked for".
# >>> ch19 replaces ch16: response_format is implemented (a grammar for the output)
#| UNSUPPORTED = {"best_of": (1,), "echo": (False,), "suffix": ("",), "presence_penalty": (0,),
#|                "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
#|                "parallel_tool_calls": (), "response_format": ({"type": "text"},)}
UNSUPPORTED = {"best_of": (1,), "echo": (False,), "suffix": ("",), "presence_penalty": (0,),
               "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
               "parallel_tool_calls": ()}
# <<< ch19


class Strict(BaseModel):
    """No unknown field, no conversion ("5" is not 5); a field sent as null is as if left out."""
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def null_is_absent(cls, body: object) -> object:
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body


class StreamOptions(Strict):
    include_usage: bool = False
# >>> ch19: OpenAI's response_format, a union told apart by its `type`


class TextFormat(Strict):
    """Plain text: no grammar."""
    type: Literal["text"]


class JSONObjectFormat(Strict):
    """Any JSON object: SamplingParams(json_object=True)."""
    type: Literal["json_object"]


class JSONSchema(Strict):
    """The schema the output follows, with OpenAI's name for it (its rule for names). `strict` is taken and
    changes nothing: the grammar always holds the output to the schema."""
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")      # `schema` would shadow BaseModel.schema
    description: str | None = None
    strict: bool | None = None


class JSONSchemaFormat(Strict):
    """JSON valid against a schema: SamplingParams(json_schema=the schema)."""
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]
TAGGED = {"response_format"}           # discriminated unions: pydantic puts the member's tag in an error's path
# <<< ch19


class Sampling(Strict):
    """The fields both endpoints take."""
    model: str
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: Annotated[tuple[str, ...], BeforeValidator(stop_rule)] = ()
    min_p: float = Field(0.0, allow_inf_nan=False)           # vLLM's and SGLang's: SamplingParams checks the ranges
    repetition_penalty: float = Field(1.0, allow_inf_nan=False)
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    # >>> ch19: a grammar for the output: OpenAI's response_format, or SGLang's regex
    response_format: ResponseFormat | None = None
    regex: str | None = None
    # <<< ch19

    @field_validator("top_k")
    @classmethod
    def top_k_rule(cls, k: int) -> int:
        if k == -1 or k >= 1:
            return k
        raise rule("invalid_value", "-1 (all tokens) or an integer >= 1")

    @field_validator("top_p")
    @classmethod
    def top_p_rule(cls, p: float) -> float:
        if 0 < p <= 1:
            return p
        raise rule("invalid_value", "in (0, 1]")

    @field_validator(*UNSUPPORTED, check_fields=False)
    @classmethod
    def unsupported(cls, value: object, info) -> object:
        if any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in UNSUPPORTED[info.field_name]):
            return None
        raise rule("unsupported_parameter", "left out: it is not supported by this server")

    @model_validator(mode="after")
    def stream_options_need_stream(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise rule("invalid_value", "stream_options is only allowed when stream is true")
        return self
    # >>> ch19: one grammar per request

    @model_validator(mode="after")
    def one_grammar(self) -> Sampling:
        kind = self.response_format.type if self.response_format is not None else "text"
        if self.regex is not None and kind != "text":
            raise rule("invalid_value", f"regex cannot be given with response_format of type {kind!r}: give one")
        return self
    # <<< ch19


class CompletionRequest(Sampling):
    prompt: Annotated[Prompt, BeforeValidator(prompt_rule)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)      # the legacy API's: the chosen token's, and the top k
    echo: Any = None
    suffix: Any = None


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, BeforeValidator(content_rule)]
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # >>> ch19 removes ch16: response_format is both endpoints' field (Sampling)
    #| response_format: Any = None
    # <<< ch19

    @model_validator(mode="after")
    def one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise rule("invalid_value", "max_completion_tokens cannot be given with max_tokens: give one")
        if self.top_logprobs is not None and not self.logprobs:
            raise rule("invalid_value", "top_logprobs is only allowed when logprobs is true")
        return self


@dataclass
class GenerateRequest:
    """What both endpoints ask of the engine."""
    prompt: Prompt                     # text or token ids (chat: the messages through the chat template)
    max_tokens: int | None             # None: up to the context
    params: dict                       # SamplingParams' fields, except max_tokens (it needs the prompt's length)
    stream: bool
    include_usage: bool                # stream_options.include_usage: a last chunk with the token counts
    n: int = 1                         # choices: n requests to the engine
    stop: tuple[str, ...] = ()         # stop strings: the text ends before the first
    logprobs: int | None = None        # None: none; 0: the chosen token's; k: and the k most likely
    limit_field: str = "max_tokens"    # the field that gave max_tokens (chat: max_completion_tokens, if sent)


class AbortRequest(Strict):
    """/abort's body: {"id": "<a response id>"} or {"all": true}."""
    id: str | None = None
    all: bool = False

    @model_validator(mode="after")
    def one_of_the_two(self) -> AbortRequest:
        if (self.id is None) == (self.all is False):
            raise rule("invalid_value", 'id or all: the body is {"id": "<a response id>"} or {"all": true}')
        return self


# ---- the body to a request
def check_model(model: str, served: str) -> None:
    """A model the server does not serve is a 404, as OpenAI answers it."""
    if model != served:
        raise APIError(f"the model {json.dumps(model)} does not exist; this server serves {served!r}",
                       param="model", status=404, code="model_not_found")


def parse_json(raw: bytes) -> dict:
    """A JSON object, parsed by pydantic's parser (jiter, in Rust)."""
    try:
        body = from_json(raw, allow_inf_nan=True)        # NaN reaches the temperature's check: "must be finite"
    except ValueError as err:
        raise APIError(f"the request body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {json.dumps(body)[:40]}", code="invalid_type")
    return body


def completion_request(req: CompletionRequest) -> GenerateRequest:
    return generate_request(req, req.prompt, req.max_tokens, req.logprobs)


def chat_request(req: ChatRequest) -> GenerateRequest:
    """The prompt is filled in once the chat template has rendered the messages. An error about the
    limit names the field that gave it."""
    out = generate_request(req, "", req.max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    if req.max_completion_tokens is not None:
        out.max_tokens, out.limit_field = req.max_completion_tokens, "max_completion_tokens"
    return out


EXTRA_SAMPLING = {"min_p", "repetition_penalty", "min_tokens", "skip_special_tokens"}   # SamplingParams' names too


def generate_request(req: Sampling, prompt: Prompt, max_tokens: int | None, logprobs: int | None) -> GenerateRequest:
    params = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
              "ignore_eos": req.ignore_eos, "stop_token_ids": tuple(req.stop_token_ids)}
    params |= req.model_dump(include=EXTRA_SAMPLING, exclude_unset=True)     # left out: SamplingParams' default
    # >>> ch19: the request's grammar
    params |= grammar_params(req)
    # <<< ch19
    include_usage = req.stream_options.include_usage if req.stream_options else False
    return GenerateRequest(prompt, max_tokens, params, req.stream, include_usage, req.n, req.stop, logprobs)


# >>> ch19: the request's grammar


def grammar_params(req: Sampling) -> dict:
    """response_format and regex as SamplingParams' json_schema, json_object and regex."""
    fmt = req.response_format
    return {"json_schema": fmt.json_schema.schema_ if isinstance(fmt, JSONSchemaFormat) else None,
            "json_object": isinstance(fmt, JSONObjectFormat), "regex": req.regex}


# SamplingParams' grammar fields -> the request's field that gave them (an error names the request's path)
API_FIELDS = {"json_schema": "response_format.json_schema.schema", "json_object": "response_format", "regex": "regex"}
API_RULES = {"json_schema": "a JSON schema", "regex": "a regular expression"}


def api_field(name: str) -> str:
    return API_FIELDS.get(name, name)


def grammar_error(err: ValueError, params: dict) -> APIError | None:
    """SamplingParams' refusal of a grammar xgrammar cannot compile, in the request's words: its path
    (response_format.json_schema.schema, regex) and its value as JSON; None for any other error."""
    name = str(err).split()[0]
    value = params.get(name)
    if name not in API_RULES or not value:
        return None
    from minioverlap.constrained.grammar import compile_error     # xgrammar: only a request with a grammar
    reason = compile_error(json.dumps(value) if name == "json_schema" else None, value if name == "regex" else None)
    if reason is None:
        return None
    return APIError(f"{api_field(name)} must be {API_RULES[name]} that xgrammar compiles, got {show(value)}: {reason}",
                    param=api_field(name), code="invalid_value")
# <<< ch19


# ---- pydantic's errors to OpenAI's
KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "string": "a string", "list": "an array",
         "tuple": "an array", "dict": "an object", "model": "an object", "literal": "one of"}


def api_error(errors: Sequence[dict]) -> APIError:
    """The first of pydantic's errors (an unknown field first), as FastAPI's RequestValidationError lists
    them (each path starts with "body"): its field as `param`, the value and the rule in the message."""
    e = sorted(errors, key=lambda e: e["type"] != "extra_forbidden")[0]
    loc = list(e["loc"])[1:] if tuple(e["loc"][:1]) == ("body",) else list(e["loc"])
    # >>> ch19: without a discriminated union's tag in the path
    loc = [p for i, p in enumerate(loc) if i == 0 or loc[i - 1] not in TAGGED]
    # <<< ch19
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    kind, ctx, value = e["type"], e.get("ctx", {}), e.get("input")
    if param is None and kind == "model_type":                # the body is JSON, but not an object
        return APIError(f"the request body must be a JSON object, got {show(value)[:40]}", code="invalid_type")
    if kind == "missing":
        return APIError(f"{param} is required", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param, code="unrecognized_argument")
    if kind in ("invalid_type", "invalid_value", "unsupported_parameter"):      # our own rules
        if kind == "unsupported_parameter":
            return APIError(f"{param}={show(value)} is not supported by this server", param=param, code=kind)
        if param is None:                                 # a rule across fields: its text names them
            return APIError(e["msg"], param=e["msg"].split()[0], code=kind)
        return APIError(f"{param} must be {e['msg']}, got {show(value)}", param=param, code=kind)
    if kind.endswith(("_type", "_parsing")):
        return APIError(f"{param} must be {KINDS.get(kind.split('_')[0], kind)}, got {show(value)}", param=param,
                        code="invalid_type")
    return APIError(f"{param} must be {bound(kind, ctx)}, got {show(value)}", param=param, code="invalid_value")


def bound(kind: str, ctx: dict) -> str:
    """A range rule as text: greater_than_equal {ge: 1} -> '>= 1'."""
    signs = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
             "less_than": ("<", "lt")}
    if kind in signs:
        sign, key = signs[kind]
        limit = ctx[key]
        return f"{sign} {int(limit) if float(limit).is_integer() else limit}"
    if kind == "finite_number":
        return "a finite number"
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    if kind == "too_short":
        return f"at least {ctx['min_length']} item(s)"
    if kind == "too_long":
        return f"at most {ctx['max_length']} items"
    # >>> ch19: a response_format's type and its schema's name
    if kind in ("union_tag_invalid", "union_tag_not_found"):          # response_format, the one such union
        return "an object whose type is 'text', 'json_object' or 'json_schema'"
    if kind == "string_pattern_mismatch":
        return f"a string matching {ctx['pattern']}"
    # <<< ch19
    return kind.replace("_", " ")


def show(value: object) -> str:
    """A value as JSON (nan as nan: JSON has no word for it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return json.dumps(value)[:80]


# ---- the request to the engine's SamplingParams
def sampling_params(req: GenerateRequest, prompt_len: int, max_seq_len: int) -> list[SamplingParams]:
    """One SamplingParams per choice: max_tokens checked against the context left after the prompt (the
    engine would stop there with "length"; a server says so before it starts). With a seed, choice i
    draws with seed + i, as vLLM seeds the n copies of a request: n choices, not n equal ones.
    SamplingParams' own errors name their field: a 400 on it (invalid_value)."""
    room, limit = max_seq_len - prompt_len, req.limit_field
    if req.max_tokens is not None and req.max_tokens > room:
        raise APIError(f"{limit} is {req.max_tokens}, but the context holds {max_seq_len} tokens and the prompt "
                       f"has {prompt_len}: at most {room}", param=limit, code="context_length_exceeded")
    fields = dict(req.params, max_tokens=room if req.max_tokens is None else req.max_tokens)
    seed = fields.pop("seed")
    try:
        return [engine_params(fields | {"seed": None if seed is None else seed + i}, req.stop, req.logprobs)
                for i in range(req.n)]
    except ValueError as err:
        error = invalid_value(err)
        # >>> ch19: a grammar xgrammar cannot compile, in the request's words
        error = grammar_error(err, req.params) or error
        # <<< ch19
        raise error from None


def engine_params(fields: dict, stop: tuple[str, ...], logprobs: int | None) -> SamplingParams:
    """SamplingParams with the stop strings and logprobs: the engine ends a request on its stop string
    (the scheduler searches the text of the tokens it has received) and computes the logprobs with the
    sample, on the device; the HTTP side only cuts the text it sends (minioverlap/text.py)."""
    return SamplingParams(**fields, stop=stop, logprobs=logprobs)


def invalid_value(err: ValueError) -> APIError:
    """The engine's own errors (SamplingParams', the Processor's) begin with the field they name."""
    # >>> ch19 replaces ch16: a grammar's field named as the request names it (json_schema: response_format)
    #| return APIError(str(err), param=str(err).split()[0], code="invalid_value")
    return APIError(str(err), param=api_field(str(err).split()[0]), code="invalid_value")
    # <<< ch19
