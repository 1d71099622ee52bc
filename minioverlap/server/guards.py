# >>> ch16 file: every error in OpenAI's body, and a limit on the body's size
"""Three guards around the routes.

Every error a client can meet comes in OpenAI's body, `{"error": {"message", "type", "param", "code"}}`:
the server's own (APIError), Starlette's (404 for an unknown path, 405 for a wrong method), FastAPI's
(RequestValidationError: a body its models refuse, which FastAPI would answer with 422 and
`{"detail": [...]}`; here a 400 naming the field, as OpenAI, vLLM and SGLang answer it, and as OpenAI's
clients read it: BadRequestError) and any other exception (500, named, its traceback in the server's log).

A body is JSON whatever its Content-Type says (`curl -d` sends a form's), parsed by pydantic's parser
before FastAPI validates it (JSONRoute): a lone surrogate or nesting past 200 is a 400, not a crash later.

A body larger than `max_bytes` is refused with 413 and never kept, parsed or tokenized: at once when its
Content-Length says so, else as soon as the bytes counted while it streams in pass the limit (chunked
uploads name no length). Without a limit, a 10 MB prompt is read, parsed and tokenized whole before the
context check refuses it. The rest of a refused body is still received, and dropped, before the answer
goes out: a server that closes a connection whose client is still sending makes the kernel reset it, and
the client may lose the answer (what web servers call a lingering close avoids the same).
"""

from __future__ import annotations

import logging

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minioverlap.server.protocol import APIError, api_error, parse_json

log = logging.getLogger("minioverlap.server")
CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def openai_errors(app: FastAPI) -> None:
    """Exception handlers that answer every error in OpenAI's body."""

    @app.exception_handler(APIError)
    async def own_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}"
        return JSONResponse(APIError(message, status=err.status_code, code=CODES.get(err.status_code)).body(),
                            status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        error = api_error(err.errors())                  # a 400 naming the first field that is wrong
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)            # Starlette calls this one last, from ServerErrorMiddleware
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("a request failed: %s %s", request.method, request.url.path)
        return JSONResponse(APIError(f"the server failed: {type(err).__name__}: {err}", status=500,
                                     type="server_error", code="internal_error").body(), status_code=500)


class JSONBody(Request):
    """A request whose body has been read and parsed already (JSONRoute): FastAPI's json() gets it."""
    parsed: dict

    async def json(self) -> dict:
        return self.parsed


class JSONRoute(APIRoute):
    """A route whose body is read and parsed before FastAPI's own reading, so that its errors are ours:
    FastAPI turns any exception while it reads a body into a bare 400 ("There was an error parsing the
    body"), which would swallow the 413 of BodyLimit and the parser's message. The body is JSON whatever
    its Content-Type says: FastAPI, seeing application/json, validates the parsed object."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:                      # GET routes: no body
            return handler

        async def parsed_first(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            body = JSONBody(dict(request.scope, headers=[*headers, (b"content-type", b"application/json")]),
                            request.receive)
            body.parsed = parse_json(await body.body())   # APIError (invalid JSON) or BodyTooLarge: answered as such
            return await handler(body)
        return parsed_first


class BodyTooLarge(APIError):
    def __init__(self, max_bytes: int, got: str) -> None:
        super().__init__(f"the request body is {got} bytes; this server takes at most {max_bytes} "
                         "(minioverlap serve --max-body-bytes)", status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware: a request body of more than `max_bytes` is refused with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            err = BodyTooLarge(self.max_bytes, length.decode())
            await self.drop_body(receive, {"type": "http.request", "more_body": True})
            return await JSONResponse(err.body(), status_code=413, headers={"connection": "close"})(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:                 # raised in the handler's read: the APIError handler answers
                await self.drop_body(receive, msg)
                raise BodyTooLarge(self.max_bytes, f"more than {self.max_bytes}")
            return msg
        await self.app(scope, counted, send)

    async def drop_body(self, receive: Receive, msg: Message) -> None:
        """Receive the rest of the body and drop it, up to 64 times the limit (then the connection closes
        anyway): the client, done sending, reads the 413."""
        dropped = 0
        while msg.get("more_body") and msg["type"] == "http.request" and dropped <= 64 * self.max_bytes:
            msg = await receive()
            dropped += len(msg.get("body", b""))
