# >>> ch16 file: the server's pieces without a server
"""Chapter 16: the server's pieces that need no engine. Logprobs, made by hand as the engine's
TokenLogprob (`.logprob`, `.top`), cross the pipe as tuples and come out in OpenAI's two shapes; an
exception inside a route is a 500 in OpenAI's body. (The text cut at a stop string is the TextStream's,
tested in test_ch16_logprobs_stop.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from minioverlap.engine.logprobs import TokenLogprob
from minioverlap.server.api import Served, create_app
from minioverlap.server.engine import logprobs
from minioverlap.server.messages import Tokens
from minioverlap.server.responses import Chat, Choice, Completion

WORDS = {1: "def", 2: " f", 3: "(x", 4: "):", 5: "\n"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS[t] for t in ids)


def test_logprobs_cross_the_pipe_and_take_openais_shapes():
    reply = SimpleNamespace(logprobs=[TokenLogprob(-0.1, [(1, -0.1), (3, -2.5)]), TokenLogprob(-0.7, [(2, -0.7), (4, -1.0)])])
    msg = Tokens(9, [1, 2], True, "length", None, logprobs(reply))
    choice = Choice(0, 9, SimpleNamespace(add=lambda ids, finished=False: decode(ids)))   # a TextStream's add
    assert choice.take(msg) == "def f" and choice.finish_reason == "length"
    legacy = Completion("tiny", lambda t: WORDS[t], logprobs=2).chunk(choice, "def f").model_dump()["choices"][0]["logprobs"]
    assert legacy == {"tokens": ["def", " f"], "token_logprobs": [-0.1, -0.7],
                      "top_logprobs": [{"def": -0.1, "(x": -2.5}, {" f": -0.7, "):": -1.0}], "text_offset": [0, 3]}
    chat = Chat("tiny", lambda t: WORDS[t], logprobs=2).chunk(choice, "def f").model_dump()["choices"][0]["logprobs"]["content"]
    assert chat[1] == {"token": " f", "logprob": -0.7, "bytes": [32, 102],
                       "top_logprobs": [{"token": " f", "logprob": -0.7, "bytes": [32, 102]},
                                        {"token": "):", "logprob": -1.0, "bytes": [41, 58]}]}
    assert Completion("tiny", lambda t: WORDS[t]).chunk(choice, "").model_dump()["choices"][0]["logprobs"] is None
    assert logprobs(SimpleNamespace(logprobs=None)) is None


def test_a_failure_inside_a_route_is_a_500_in_openais_body():
    engine = SimpleNamespace(start=lambda loop: None, stop=lambda: None, alive=True)
    processor = SimpleNamespace(max_seq_len=1024)
    app = create_app(engine, Served("tiny", processor, SimpleNamespace(template=None)))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as http:
        reply = http.get("/boom")
    assert reply.status_code == 500
    assert reply.json() == {"error": {"message": "the server failed: RuntimeError: a bug", "type": "server_error",
                                      "param": None, "code": "internal_error"}}
