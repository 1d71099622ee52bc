# >>> ch16 file: the HTTP side
"""The HTTP side: OpenAI's routes on FastAPI, in the server's main process.

A request's path: its body checked (protocol.py's pydantic models, the routes' parameters: FastAPI
validates the body against them and lists them in /openapi.json; responses.py's models are the answers), its prompt tokenized and checked
against the context (the Processor of llm.py, without the model) in a worker thread, so that a long
prompt stalls no other request; the request made (Processor.make_request: the one place it is checked,
every error a 400) and sent to the scheduler process, then its tokens streamed back as server-sent
events (sse-starlette frames them) or gathered into one body, detokenized on the way (minioverlap/text.py).
A request with n choices is n requests to the engine. A client that leaves, whether its request runs or
still waits in the queue, aborts it: a stream's generator is cancelled when the connection closes; a
plain request watches the connection.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from minioverlap.processor import Processor, Prompt
from minioverlap.sampling_params import SamplingParams
from minioverlap.server.client import EngineClient, EngineGone, RequestRejected
from minioverlap.server.guards import BodyLimit, JSONRoute, openai_errors
from minioverlap.server.messages import Tokens
from minioverlap.server.metrics import AccessLog, Metrics
from minioverlap.server.protocol import (AbortRequest, APIError, ChatRequest, CompletionRequest, ErrorResponse,
                                         GenerateRequest, chat_request, check_model, completion_request, invalid_value,
                                         sampling_params)
# >>> ch19: a grammar the engine could not compile, named as the request names it
from minioverlap.server.protocol import api_field
# <<< ch19
from minioverlap.server.responses import (Chat, ChatCompletionResponse, Choice, Choices, Completion,
                                          CompletionResponse, ModelCard, ModelList, Shape)
from minioverlap.server.text import ChatTemplate
from minioverlap.text import TextStream


@dataclass
class Served:
    """What the HTTP side knows of the model: its name, the Processor (tokenizer, vocabulary, context),
    the chat template, and the server's limits."""
    name: str
    processor: Processor
    chat: ChatTemplate
    max_body_bytes: int = 1 << 20
    grace: float = 5.0                 # seconds a stream in flight gets when the server stops


def create_app(engine: EngineClient, served: Served) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()                            # after uvicorn's graceful shutdown: abort what is left

    app = FastAPI(title="minioverlap", lifespan=lifespan)
    app.router.route_class = JSONRoute           # a body is parsed by pydantic's parser, whatever its Content-Type
    openai_errors(app)
    metrics, routes = Metrics(), set()           # routes: filled below, once the app has them
    app.add_middleware(BodyLimit, max_bytes=served.max_body_bytes)
    app.add_middleware(AccessLog, metrics=metrics, routes=routes)   # outermost: it sees a 413 too
    responses: dict[str, int] = {}               # a response's id -> its first request in the engine (for /abort)
    errors = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}     # in /openapi.json

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if engine.alive else engine.why},
                            status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served.name, max_model_len=served.processor.max_seq_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(body: CompletionRequest, request: Request):
        """A completion, whole or streamed (stream: true, server-sent events of CompletionChunk)."""
        check_model(body.model, served.name)
        req = completion_request(body)
        return await generate(request, req, Completion(served.name, token_text, req.logprobs))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat_completions(body: ChatRequest, request: Request):
        """A chat completion, whole or streamed (stream: true, server-sent events of ChatCompletionChunk)."""
        check_model(body.model, served.name)
        if served.chat.template is None:
            raise APIError(f"the model {served.name!r} has no chat template (its tokenizer_config.json has no "
                           "chat_template): use /v1/completions", param="messages", code="no_chat_template")
        req = chat_request(body)
        messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
        try:
            req.prompt = await asyncio.to_thread(served.chat.render, messages)
        except ValueError as err:
            raise APIError(str(err), param="messages", code="invalid_value") from None
        return await generate(request, req, Chat(served.name, token_text, req.logprobs))

    @app.post("/abort", responses=errors)
    async def abort(body: AbortRequest) -> dict:
        """{"id": "cmpl-..."} (a response's id) or {"all": true}: the requests end with finish_reason "abort"."""
        if body.all:
            return {"aborted": engine.abort_all()}
        rid = responses.get(body.id)
        if rid is None or rid not in engine.streams:          # unknown, or finished already
            return {"aborted": 0}
        engine.abort_group(rid)
        return {"aborted": 1}

    @app.get("/integrity")
    async def integrity() -> dict:
        """The engine's integrity report: with nothing queued or running, every page and slot is free."""
        try:
            return asdict(await engine.integrity())
        except EngineGone as err:
            raise APIError(str(err), status=503, type="server_error") from None

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The counters, histograms and gauges of metrics.py, in Prometheus' text format."""
        try:
            metrics.scheduler(await engine.integrity())
        except EngineGone:                       # the engine has stopped: its gauges stay as they were
            pass
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def text_stream(params: SamplingParams) -> TextStream:
        """A choice's text as its tokens come: cut at its stop strings (none before min_tokens), special
        tokens kept if it asks (skip_special_tokens=False)."""
        return TextStream(served.processor.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)

    def token_text(token_id: int) -> str:
        return served.processor.decode([token_id])

    def remember(response_id: str, rid: int) -> None:
        """Map a response's id to its engine request, for /abort; forget the requests that have ended."""
        for done in [key for key, r in responses.items() if r not in engine.streams]:
            del responses[done]
        responses[response_id] = rid

    async def generate(request: Request, req: GenerateRequest, shape: Shape):
        param = "messages" if isinstance(shape, Chat) else "prompt"
        ids = await asyncio.to_thread(encode, served.processor, req.prompt, param)
        # >>> ch19 replaces ch16: SamplingParams made in a worker thread, where a grammar compiles (stalling no stream)
        #| try:
        #|     reqs = [served.processor.make_request(ids, p) for p in
        #|             sampling_params(req, len(ids), served.processor.max_seq_len)]
        params = await asyncio.to_thread(sampling_params, req, len(ids), served.processor.max_seq_len)
        try:
            reqs = [served.processor.make_request(ids, p) for p in params]
            # <<< ch19
            rids, queue = await engine.add(reqs)
        # >>> ch19 replaces ch16: or a grammar the engine could not compile
        #| except RequestRejected as err:
        #|     raise APIError(str(err), param=req.limit_field, code="too_large_for_the_pool") from None
        except RequestRejected as err:
            raise rejected(err, req.limit_field) from None
        # <<< ch19
        except ValueError as err:                # stop_token_ids outside the vocabulary
            raise invalid_value(err) from None
        except EngineGone as err:
            raise APIError(str(err), status=503, type="server_error") from None
        shape.prompt_tokens, meter = len(ids), metrics.meter(len(ids))
        remember(shape.id, rids[0])
        choices = Choices([Choice(i, rid, text_stream(r.params), meter=meter) for i, (rid, r) in enumerate(zip(rids, reqs))])
        if not req.stream:
            return await gather(engine, request, queue, choices, shape)
        try:
            return await sse(stream(engine, queue, choices, shape, req.include_usage), served.grace)
        except Exception:                        # no stream to send: its requests must not run for nobody
            for rid in choices.running():
                engine.abort(rid)
            raise

    routes.update(route.path for route in app.routes)
    return app


def encode(processor: Processor, prompt: Prompt, param: str) -> list[int]:
    """The prompt's token ids (in a worker thread: a long text takes a while), checked against the
    vocabulary and the context."""
    try:
        return processor.encode(prompt)
    except ValueError as err:                    # empty, outside the vocabulary, or too long for the context
        too_long = "the context holds" in str(err)
        raise APIError(str(err), param=param, code="context_length_exceeded" if too_long else "invalid_prompt") from None


# >>> ch19: a grammar the engine could not compile


def rejected(err: RequestRejected, limit_field: str) -> APIError:
    """The engine's refusal: a request too large for the page pool (named by the field of its limit), or
    a grammar it could not compile."""
    if err.field is None:
        return APIError(str(err), param=limit_field, code="too_large_for_the_pool")
    return APIError(str(err), param=api_field(err.field), code="invalid_value")
# <<< ch19


async def sse(events: AsyncIterator[str], grace: float) -> EventSourceResponse:
    """The events as server-sent events, each framed `data: ...` by sse-starlette. When the server stops,
    sse-starlette would cut the stream at once; it waits `grace` + 1 s instead, by which time the stream
    has ended itself with an error event (GracefulServer)."""
    if inspect.iscoroutine(events):              # a stream() with no yield (exercise 16.1's stub): its error, a 500
        await events
        raise TypeError("stream() must be an async generator: it yields the events")
    return EventSourceResponse(events, shutdown_grace_period=grace + 1)


# ---- the two ways back: a stream of events, or one body
async def stream(engine: EngineClient, queue: asyncio.Queue, choices: Choices, shape: Shape,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step of each choice, the last of each with its finish_reason,
    [DONE]. If the client leaves, sse-starlette cancels this generator where it waits: the requests
    still running are aborted."""
    # >>> exercise 16.1: a client that leaves aborts its request
    try:
        if shape.first_chunk:
            for choice in choices.all:
                yield event(shape.role_chunk(choice))
        while not choices.finished:
            msg = await queue.get()
            if failed(msg):                      # an error event ends the stream
                yield event(error_body(msg))
                break
            if (choice := choices.of(msg)) is not None:
                yield event(shape.chunk(choice, choice.take(msg)))
        if include_usage and choices.finished:
            yield event(shape.usage_chunk(choices))
        yield "[DONE]"
    finally:
        for rid in choices.running():
            engine.abort(rid)
    # <<< exercise 16.1


def failed(msg: Tokens | EngineGone) -> bool:
    return isinstance(msg, EngineGone) or msg.finish_reason == "error"


def error_body(msg: Tokens | EngineGone) -> ErrorResponse:
    return APIError(str(msg) if isinstance(msg, EngineGone) else msg.error or "the request failed",
                    status=503 if isinstance(msg, EngineGone) else 500, type="server_error").response()


async def gather(engine: EngineClient, request: Request, queue: asyncio.Queue, choices: Choices,
                 shape: Shape) -> BaseModel | JSONResponse:
    """Wait for every token of every choice, watching the connection: a client that leaves aborts them."""
    tokens = asyncio.ensure_future(all_tokens(engine, queue, choices))
    left = asyncio.ensure_future(disconnected(request))
    await asyncio.wait({tokens, left}, return_when=asyncio.FIRST_COMPLETED)
    left.cancel()
    if not tokens.done():
        tokens.cancel()
        for rid in choices.running():
            engine.abort(rid)
        return JSONResponse({}, status_code=499)         # nobody reads it: the client has gone
    failure, texts = tokens.result()
    if failure is not None:
        body = error_body(failure).model_dump()
        return JSONResponse(body, status_code=503 if isinstance(failure, EngineGone) else 500)
    return shape.full([(c, "".join(t), lps) for c, (t, lps) in zip(choices.all, texts)], choices)


async def all_tokens(engine: EngineClient, queue: asyncio.Queue,
                     choices: Choices) -> tuple[Tokens | EngineGone | None, list[tuple[list[str], list]]]:
    """Each choice's text pieces and logprobs; the message that failed them, or None."""
    texts: list[tuple[list[str], list]] = [([], []) for _ in choices.all]
    while not choices.finished:
        msg = await queue.get()
        if failed(msg):
            return msg, texts
        if (choice := choices.of(msg)) is not None:
            texts[choice.index][0].append(choice.take(msg))
            texts[choice.index][1].extend(choice.logprobs)
    return None, texts


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read: the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def event(body: BaseModel) -> str:
    """A chunk's JSON: sse-starlette writes it as `data: <json>` and the blank line after."""
    return body.model_dump_json()
