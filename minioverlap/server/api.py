# >>> ch16 file: the HTTP side
"""The HTTP side: OpenAI's routes on FastAPI, in the server's main process.

A request's path: its body checked (protocol.py), its prompt tokenized and checked against the context
(the Processor of llm.py, without the model), the request sent to the scheduler process and accepted
there, then its tokens streamed back as server-sent events or gathered into one body, detokenized on
the way (text.py). A client that leaves, whether its request runs or still waits in the queue, aborts it:
a stream's generator is cancelled when the connection closes; a plain request watches the connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from minioverlap.processor import Processor
from minioverlap.server.client import EngineClient, EngineGone, RequestRejected
from minioverlap.server.engine import Tokens
from minioverlap.server.protocol import (APIError, GenerateRequest, invalid_value, parse_body, parse_chat,
                                         parse_completion, sampling_params)
from minioverlap.server.text import ChatTemplate, Detokenizer


@dataclass
class Served:
    """What the HTTP side knows of the model: its name, the Processor (tokenizer, vocabulary, context)
    and the chat template."""
    name: str
    processor: Processor
    chat: ChatTemplate


def create_app(engine: EngineClient, served: Served) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()                            # after uvicorn's graceful shutdown: abort what is left

    app = FastAPI(title="minioverlap", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if engine.alive else "the engine has stopped"},
                            status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "minioverlap",
                                            "max_model_len": served.processor.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(parse_body(await request.body()), served.name)
        return await generate(request, req, Completion(served.name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        messages, req = parse_chat(parse_body(await request.body()), served.name)
        if served.chat.template is None:
            raise APIError(f"the model {served.name!r} has no chat template (its tokenizer_config.json has no "
                           "chat_template): use /v1/completions", param="messages", code="no_chat_template")
        try:
            req.prompt = served.chat.render(messages)
        except ValueError as err:
            raise APIError(str(err), param="messages", code="invalid_value") from None
        return await generate(request, req, Chat(served.name))

    @app.post("/abort")
    async def abort(request: Request) -> dict:
        """{"id": "cmpl-7"} (a response's id) or {"all": true}: the requests end with finish_reason "abort"."""
        body = parse_body(await request.body())
        if body.get("all") is True and set(body) == {"all"}:
            return {"aborted": engine.abort_all()}
        rid = request_number(body.get("id")) if set(body) == {"id"} else None
        if rid is None:
            raise APIError('the body must be {"id": "<a response id>"} or {"all": true}', param="id",
                           code="invalid_value")
        known = rid in engine.streams
        engine.abort(rid)
        return {"aborted": int(known)}

    @app.get("/integrity")
    async def integrity() -> dict:
        """The engine's integrity report: with nothing queued or running, every page and slot is free."""
        try:
            return asdict(await engine.integrity())
        except EngineGone as err:
            raise APIError(str(err), status=503, type="server_error") from None

    async def generate(request: Request, req: GenerateRequest, shape: Shape):
        try:
            ids = served.processor.encode(req.prompt)
        except ValueError as err:                # empty, outside the vocabulary, or too long for the context
            too_long = "the context holds" in str(err)
            raise APIError(str(err), param="messages" if isinstance(shape, Chat) else "prompt",
                           code="context_length_exceeded" if too_long else "invalid_prompt") from None
        params = sampling_params(req, len(ids), served.processor.max_seq_len)
        try:
            served.processor.make_request(ids, params)           # its stop tokens against the vocabulary
            rid, queue = await engine.add(ids, params)
        except RequestRejected as err:
            raise APIError(str(err), param="max_tokens", code="too_large_for_the_pool") from None
        except ValueError as err:
            raise invalid_value(err) from None
        except EngineGone as err:
            raise APIError(str(err), status=503, type="server_error") from None
        shape.rid, shape.prompt_tokens = rid, len(ids)
        text = Detokenizer(served.processor.decode)
        if req.stream:
            return StreamingResponse(stream(engine, queue, text, shape, req.include_usage),
                                     media_type="text/event-stream")
        return await gather(engine, request, queue, text, shape)

    return app


def request_number(response_id: object) -> int | None:
    """The engine's id in a response id: 'cmpl-7' or 'chatcmpl-7' -> 7."""
    if not isinstance(response_id, str) or "-" not in response_id:
        return None
    number = response_id.rsplit("-", 1)[1]
    return int(number) if number.isdigit() else None


# ---- the two ways back: a stream of events, or one body
async def stream(engine: EngineClient, queue: asyncio.Queue, text: Detokenizer, shape: Shape,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step, the last with its finish_reason, [DONE]. If the client
    leaves, Starlette cancels this generator where it waits: the request is aborted."""
    # >>> exercise 16.1: a client that leaves aborts its request
    finished, tokens = False, 0
    try:
        if shape.first_chunk:
            yield event(shape.chunk(None, None, first=True))
        while not finished:
            msg = await queue.get()
            if isinstance(msg, EngineGone) or msg.finish_reason == "error":   # an error event ends the stream
                yield event(APIError(str(msg) if isinstance(msg, EngineGone) else msg.error or "the request failed",
                                     type="server_error").body())
                break
            finished, tokens = msg.finished, tokens + len(msg.token_ids)
            yield event(shape.chunk(text.add(msg.token_ids, last=finished), msg.finish_reason if finished else None))
        if include_usage and finished:
            yield event(shape.usage_chunk(tokens))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.abort(shape.rid)
    # <<< exercise 16.1


async def gather(engine: EngineClient, request: Request, queue: asyncio.Queue, text: Detokenizer,
                 shape: Shape) -> JSONResponse:
    """Wait for every token, watching the connection: a client that leaves aborts the request."""
    tokens = asyncio.ensure_future(all_tokens(queue))
    left = asyncio.ensure_future(disconnected(request))
    await asyncio.wait({tokens, left}, return_when=asyncio.FIRST_COMPLETED)
    left.cancel()
    if not tokens.done():
        tokens.cancel()
        engine.abort(shape.rid)
        return JSONResponse({}, status_code=499)         # nobody reads it: the client has gone
    msg, ids = tokens.result()
    if isinstance(msg, EngineGone):
        raise APIError(str(msg), status=503, type="server_error")
    if msg.finish_reason == "error":
        raise APIError(msg.error or "the request failed", status=500, type="server_error")
    return JSONResponse(shape.full(text.add(ids, last=True), msg.finish_reason, len(ids)))


async def all_tokens(queue: asyncio.Queue) -> tuple[Tokens | EngineGone, list[int]]:
    ids: list[int] = []
    while True:
        msg = await queue.get()
        if isinstance(msg, EngineGone):
            return msg, ids
        ids += msg.token_ids
        if msg.finished:
            return msg, ids


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read: the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def event(body: dict | str) -> str:
    return body if isinstance(body, str) else f"data: {json.dumps(body)}\n\n"


# ---- the bodies of the two endpoints
class Shape:
    """The response bodies of one endpoint for one request."""
    object = prefix = ""
    first_chunk = False

    def __init__(self, model: str) -> None:
        self.model, self.created = model, int(time.time())
        self.rid, self.prompt_tokens = 0, 0

    def head(self, object_name: str) -> dict:
        return {"id": f"{self.prefix}-{self.rid}", "object": object_name, "created": self.created, "model": self.model}

    def usage(self, tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                "total_tokens": self.prompt_tokens + tokens}

    def usage_chunk(self, tokens: int) -> dict:
        return self.head(self.object + ".chunk" if self.first_chunk else self.object) | {
            "choices": [], "usage": self.usage(tokens)}


class Completion(Shape):
    object, prefix = "text_completion", "cmpl"

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        return self.head(self.object) | {
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}

    def full(self, text: str, finish_reason: str, tokens: int) -> dict:
        return self.chunk(text, finish_reason) | {"usage": self.usage(tokens)}


class Chat(Shape):
    object, prefix = "chat.completion", "chatcmpl"
    first_chunk = True                           # the first chunk names the role

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return self.head(self.object + ".chunk") | {
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def full(self, text: str, finish_reason: str, tokens: int) -> dict:
        return self.head(self.object) | {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": self.usage(tokens)}
