# >>> ch16 file: the OpenAI request bodies, checked field by field
"""The bodies of /v1/completions and /v1/chat/completions, checked one field at a time, and OpenAI's
error body for each that is wrong: `{"error": {"message", "type", "param", "code"}}`, status 400 (404
for a model the server does not serve). A field the engine does not implement is refused, not ignored:
n > 1, logprobs, stop strings, penalties and tools would otherwise be silently dropped.

The fields beyond OpenAI's (`top_k`, `ignore_eos`, `stop_token_ids`) are vLLM's and SGLang's names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from minioverlap.processor import Prompt
from minioverlap.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerateRequest:
    """What both endpoints ask of the engine."""
    prompt: Prompt                     # text or token ids (chat: the messages through the chat template)
    max_tokens: int | None             # None: up to the context
    params: dict                       # SamplingParams' fields, except max_tokens (it needs the prompt's length)
    stream: bool
    include_usage: bool                # stream_options.include_usage: a last chunk with the token counts


# The fields each endpoint takes, beyond `model`: name -> (JSON types, default).
SAMPLING = {"temperature": ((int, float), 1.0), "top_p": ((int, float), 1.0), "top_k": ((int,), -1),
            "seed": ((int, type(None)), None), "ignore_eos": ((bool,), False),
            "stop_token_ids": ((list, type(None)), None), "stream": ((bool,), False),
            "stream_options": ((dict, type(None)), None), "user": ((str, type(None)), None)}
# Fields OpenAI has and this engine does not implement: name -> the values that mean "not asked for".
UNSUPPORTED = {"n": (1, None), "best_of": (1, None), "logprobs": (None, False), "top_logprobs": (None, 0),
               "echo": (False, None), "suffix": (None,), "stop": (None, [], ""),
               "presence_penalty": (0, None), "frequency_penalty": (0, None), "logit_bias": (None, {}),
               "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "parallel_tool_calls": (None,)}
COMPLETION = {"prompt": ((str, list), None), "max_tokens": ((int, type(None)), 16)} | SAMPLING
CHAT = {"messages": ((list,), None), "max_tokens": ((int, type(None)), None),
        "max_completion_tokens": ((int, type(None)), None)} | SAMPLING
ROLES = ("system", "user", "assistant")
JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object"}


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(f"the request body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {json.dumps(body)[:40]}", code="invalid_type")
    return body


def checked_fields(body: dict, fields: dict, model: str) -> dict:
    """Every field of `fields` (its default where absent or null), after `model`, the unknown and the
    unsupported fields are refused."""
    check_model(body, model)
    for name, value in body.items():
        if name in UNSUPPORTED:
            if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in UNSUPPORTED[name]):
                raise APIError(f"{name}={json.dumps(value)} is not supported by this server", param=name,
                               code="unsupported_parameter")
        elif name not in fields and name != "model":
            raise APIError(f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_argument")
    out = {}
    for name, (types, default) in fields.items():
        value = body.get(name)
        if value is None:
            if default is None and type(None) not in types:
                raise APIError(f"{name} is required", param=name, code="missing_required_parameter")
            value = default
        elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            kinds = " or ".join(JSON_NAMES[t] for t in types if t is not type(None))
            raise APIError(f"{name} must be {kinds}, got {json.dumps(value)}", param=name, code="invalid_type")
        out[name] = value
    return out


def check_model(body: dict, model: str) -> None:
    if "model" not in body or body["model"] is None:
        raise APIError("you must provide a model parameter", param="model", code="missing_required_parameter")
    if body["model"] != model:
        raise APIError(f"the model {json.dumps(body['model'])} does not exist; this server serves {model!r}",
                       param="model", status=404, code="model_not_found")


def parse_completion(body: dict, model: str) -> GenerateRequest:
    fields = checked_fields(body, COMPLETION, model)
    prompt = fields["prompt"]
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise APIError("prompt must be text or a list of token ids (one prompt per request: a list of prompts is "
                       "not supported)", param="prompt", code="invalid_type")
    return request(fields, prompt, fields["max_tokens"])


def parse_chat(body: dict, model: str) -> tuple[list[dict], GenerateRequest]:
    """The messages (checked: a role and text content each) and the request; the prompt is filled in
    once the chat template has rendered them."""
    fields = checked_fields(body, CHAT, model)
    if fields["max_tokens"] is not None and fields["max_completion_tokens"] is not None:
        raise APIError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    messages = [chat_message(i, m) for i, m in enumerate(fields["messages"])]
    if not messages:
        raise APIError("messages must hold at least 1 message", param="messages", code="empty_array")
    limit = fields["max_completion_tokens"] if fields["max_completion_tokens"] is not None else fields["max_tokens"]
    return messages, request(fields, "", limit)


def chat_message(i: int, message: object) -> dict:
    """One message as the chat template takes it: a role and its text (a list of text parts is joined)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"{where} must be an object with a role and a content", param=where, code="invalid_type")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise APIError(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                       param=f"{where}.role", code="invalid_value")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"{where}.content must be text or a list of text parts, got {json.dumps(content)}",
                       param=f"{where}.content", code="invalid_type")
    return {"role": role, "content": content}


def request(fields: dict, prompt: Prompt, max_tokens: int | None) -> GenerateRequest:
    options = fields["stream_options"] or {}
    if options and not fields["stream"]:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options",
                       code="invalid_value")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise APIError(f"stream_options must be {{\"include_usage\": true or false}}, got {json.dumps(options)}",
                       param="stream_options", code="invalid_value")
    for name in ("temperature", "top_p"):
        if not math.isfinite(fields[name]):
            raise APIError(f"{name} must be a finite number, got {fields[name]}", param=name, code="invalid_value")
    params = {name: fields[name] for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos")}
    params["stop_token_ids"] = tuple(fields["stop_token_ids"] or ())
    return GenerateRequest(prompt, max_tokens, params, fields["stream"], options.get("include_usage", False))


def sampling_params(req: GenerateRequest, prompt_len: int, max_seq_len: int) -> SamplingParams:
    """The request's SamplingParams: max_tokens checked against the context left after the prompt (the
    engine would stop there with "length"; a server says so before it starts). SamplingParams' own
    errors name their field: they become a 400 on it (invalid_value)."""
    room = max_seq_len - prompt_len
    if req.max_tokens is not None and req.max_tokens > room:
        raise APIError(f"max_tokens is {req.max_tokens}, but the context holds {max_seq_len} tokens and the prompt "
                       f"has {prompt_len}: at most {room}", param="max_tokens", code="context_length_exceeded")
    try:
        return SamplingParams(max_tokens=room if req.max_tokens is None else req.max_tokens, **req.params)
    except ValueError as err:
        raise invalid_value(err) from None


def invalid_value(err: ValueError) -> APIError:
    """The engine's own errors (SamplingParams', the Processor's) begin with the field they name."""
    return APIError(str(err), param=str(err).split()[0], code="invalid_value")
