# >>> ch16 file: bad requests get OpenAI's error body and change nothing
"""Chapter 16: a bad request to the server gets OpenAI's error body, `{"error": {"message", "type",
"param", "code"}}`, with status 400 (404 for a model it does not serve), `param` naming the field that
is wrong and the message naming the value or the limit. None of them reaches the engine: its integrity
report, the count of finished requests included, is the same after each, and a greedy request still
gives the text it gave before them.

An unknown path (404), a wrong method (405) and a body over the size limit (413) get the same body; so
does a failure inside the server (500, tests/test_ch16_responses.py). A request too large for the page pool (the scheduler's Rejected, code "too_large_for_the_pool") needs
a server with a small pool: tests/test_ch16_serving.py starts one.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from serving import Server

pytestmark = pytest.mark.process

MODEL = "tiny"                  # vocabulary 4096, context 1024, a ChatML chat template
GOOD = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}


def greedy_text(server: Server) -> str:
    reply = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60.0)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server():
    """One server for the module, with its greedy text and integrity report before any bad request."""
    server = Server()
    try:
        server.greedy = greedy_text(server)
        server.report = server.wait_idle()
        yield server
    finally:
        code, out = server.stop()
    assert code == 0, f"the server exited with {code} after SIGTERM:\n{out}"


def body(**fields) -> dict:
    """A good completion body with `fields` changed (None: the field left out)."""
    return {k: v for k, v in (GOOD | fields).items() if v is not None}


# (body: a dict, sent as JSON, or bytes, sent as they are), status, param, code, words the message holds
CASES = [
    pytest.param(b'{"model": "tiny", "prompt": ', 400, None, "invalid_json", ["not valid JSON"], id="malformed-json"),
    pytest.param(b'[1, 2, 3]', 400, None, "invalid_type", ["JSON object", "[1, 2, 3]"], id="json-array"),
    pytest.param(body(prompt=None), 400, "prompt", "missing_required_parameter", ["prompt", "required"],
                 id="no-prompt"),
    pytest.param(body(prompt=""), 400, "prompt", "invalid_prompt", ["empty", "1 token"], id="empty-text"),
    pytest.param(body(prompt=[]), 400, "prompt", "invalid_prompt", ["empty", "1 token"], id="empty-ids"),
    pytest.param(body(prompt=5), 400, "prompt", "invalid_type", ["got 5"], id="prompt-number"),
    pytest.param(body(prompt=["a", "b"]), 400, "prompt", "invalid_type", ["token ids", "list of prompts"],
                 id="prompt-list-of-strings"),
    pytest.param(body(prompt=[1, 4096]), 400, "prompt", "invalid_prompt", ["4096", "[0, 4096)"],
                 id="token-outside-vocabulary"),
    pytest.param(body(prompt=[1] * 1024), 400, "prompt", "context_length_exceeded", ["1024", "at most 1023"],
                 id="prompt-fills-context"),
    pytest.param(body(max_tokens=0), 400, "max_tokens", "invalid_value", [">= 1", "got 0"], id="max_tokens-0"),
    pytest.param(body(max_tokens=-1), 400, "max_tokens", "invalid_value", [">= 1", "got -1"], id="max_tokens--1"),
    pytest.param(body(max_tokens="5"), 400, "max_tokens", "invalid_type", ['"5"'], id="max_tokens-text"),
    pytest.param(body(max_tokens=True), 400, "max_tokens", "invalid_type", ["true"], id="max_tokens-bool"),
    pytest.param(body(prompt=[1] * 10, max_tokens=1015), 400, "max_tokens", "context_length_exceeded",
                 ["1015", "1024", "at most 1014"], id="max_tokens-past-context"),
    pytest.param(body(temperature=-1), 400, "temperature", "invalid_value", [">= 0", "got -1"], id="temperature--1"),
    pytest.param(b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature", "invalid_value",
                 ["finite", "nan"], id="temperature-NaN"),     # not JSON, but Python's json reads it
    pytest.param(body(temperature="hot"), 400, "temperature", "invalid_type", ['"hot"'], id="temperature-text"),
    pytest.param(body(top_p=0), 400, "top_p", "invalid_value", ["(0, 1]", "got 0"], id="top_p-0"),
    pytest.param(body(top_p=1.5), 400, "top_p", "invalid_value", ["(0, 1]", "got 1.5"], id="top_p-1.5"),
    pytest.param(body(top_k=0), 400, "top_k", "invalid_value", ["-1", "got 0"], id="top_k-0"),
    pytest.param(body(n=17), 400, "n", "invalid_value", ["<= 16", "got 17"], id="n-17"),
    pytest.param(body(best_of=2), 400, "best_of", "unsupported_parameter", ["best_of=2"], id="best_of-2"),
    pytest.param(body(logprobs=6), 400, "logprobs", "invalid_value", ["<= 5", "got 6"], id="logprobs-6"),
    pytest.param(body(logprobs=True), 400, "logprobs", "invalid_type", ["integer", "true"], id="logprobs-bool"),
    pytest.param(body(echo=True), 400, "echo", "unsupported_parameter", ["echo=true"], id="echo"),
    pytest.param(body(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value", ["at most 4"], id="stop-5"),
    pytest.param(body(stop=[1]), 400, "stop", "invalid_type", ["a string or a list"], id="stop-number"),
    pytest.param(body(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter",
                 ["presence_penalty=0.5"], id="presence_penalty"),
    pytest.param(body(foo=1), 400, "foo", "unrecognized_argument", ["Unrecognized request argument supplied: foo"],
                 id="unknown-field"),
    pytest.param(b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None, "invalid_json", ["not valid JSON"],
                 id="lone-surrogate"),
    pytest.param(b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "invalid_json",
                 ["not valid JSON", "recursion"], id="nested-100000-deep"),
    pytest.param(body(model=None), 400, "model", "missing_required_parameter", ["model"], id="no-model"),
    pytest.param(body(model="gpt-4o"), 404, "model", "model_not_found", ['"gpt-4o"', "tiny"], id="wrong-model"),
    pytest.param(body(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value", ["stream"],
                 id="stream_options-without-stream"),
    pytest.param(body(stop_token_ids=[5000]), 400, "stop_token_ids", "invalid_value", ["5000", "[0, 4096)"],
                 id="stop_token_ids-outside-vocabulary"),
]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CHAT_CASES = [
    pytest.param(b'{"model": "tiny", "messages": ', 400, None, "invalid_json", ["not valid JSON"], id="malformed-json"),
    pytest.param(CHAT | {"model": "gpt-4o"}, 404, "model", "model_not_found", ['"gpt-4o"'], id="wrong-model"),
    pytest.param({"model": MODEL}, 400, "messages", "missing_required_parameter", ["required"], id="no-messages"),
    pytest.param(CHAT | {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "invalid_value",
                 ['"robot"'], id="bad-role"),
    pytest.param(CHAT | {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type",
                 ["text", "got 5"], id="content-number"),
    pytest.param(CHAT | {"messages": []}, 400, "messages", "invalid_value", ["at least 1"], id="no-message"),
    pytest.param(CHAT | {"max_completion_tokens": 4}, 400, "max_completion_tokens", "invalid_value", ["max_tokens"],
                 id="two-limits"),
    pytest.param(CHAT | {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value", ["logprobs is true"],
                 id="top_logprobs-without-logprobs"),
    pytest.param(CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value", ["<= 20"],
                 id="top_logprobs-21"),
    pytest.param(CHAT | {"tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter", ["tools="],
                 id="tools"),
    pytest.param(CHAT | {"echo": True}, 400, "echo", "unrecognized_argument", ["echo"], id="echo-in-chat"),
]


def post(server: Server, path: str, payload: dict | bytes) -> httpx.Response:
    if isinstance(payload, bytes):
        return httpx.post(f"{server.url}{path}", content=payload, headers={"content-type": "application/json"},
                          timeout=60.0)
    return httpx.post(f"{server.url}{path}", json=payload, timeout=60.0)


def assert_error(reply: httpx.Response, status: int, param: str | None, code: str | None, words: list[str]) -> None:
    """OpenAI's error body, exactly its four keys, naming the field and (in the message) the value or limit."""
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    error = error["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("payload, status, param, code, words", CASES)
def test_a_bad_completion_gets_the_error_body_naming_its_field(server, payload, status, param, code, words):
    """The error body names the field and the value; the engine never saw the request."""
    assert_error(post(server, "/v1/completions", payload), status, param, code, words)
    assert server.integrity() == server.report


@pytest.mark.parametrize("payload, status, param, code, words", CHAT_CASES)
def test_a_bad_chat_request_gets_the_error_body_naming_its_field(server, payload, status, param, code, words):
    assert_error(post(server, "/v1/chat/completions", payload), status, param, code, words)
    assert server.integrity() == server.report


def test_zeros_that_mean_not_asked_for_are_accepted_as_floats(server):
    """Python clients send 0.0: a penalty of 0.0 asks for nothing, like 0, and is served."""
    reply = post(server, "/v1/completions", body(presence_penalty=0.0, frequency_penalty=0.0, max_tokens=2))
    assert reply.status_code == 200, reply.text
    server.report = server.wait_idle()          # one more finished request: the baseline of the tests after


def test_the_openai_client_raises_bad_request_naming_the_param(server):
    """The official client reads the error body: BadRequestError, status 400, the param in err.body."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60.0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=0)
    err = caught.value
    assert err.status_code == 400
    assert err.body["param"] == "max_tokens" and err.body["code"] == "invalid_value", err.body
    assert "got 0" in err.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4o", prompt="def add(a, b):", max_tokens=4)
    assert caught.value.status_code == 404 and caught.value.body["param"] == "model"
    assert server.integrity() == server.report


@pytest.mark.parametrize("method, path, status, code", [("GET", "/v1/nothing", 404, "not_found"),
                                                       ("GET", "/v1/completions", 405, "method_not_allowed"),
                                                       ("DELETE", "/v1/chat/completions", 405, "method_not_allowed")])
def test_an_unknown_path_or_method_gets_the_error_body(server, method, path, status, code):
    """Starlette's own errors, in OpenAI's body rather than FastAPI's {"detail": ...}."""
    assert_error(httpx.request(method, f"{server.url}{path}", timeout=10.0), status, None, code, [path])


def test_a_10_mb_prompt_is_refused_with_413_and_stalls_no_stream(server):
    """A body over the limit (1 MiB here) is refused without being kept or parsed: by its Content-Length,
    or, sent in chunks with no length, once the bytes counted pass the limit. A stream running meanwhile keeps its
    pace: the longest gap between its chunks stays small (the bound is generous: machines are noisy)."""
    big = json.dumps({"model": MODEL, "prompt": "def f(x):\n" * 1_000_000}).encode()
    assert len(big) > 10_000_000
    times: list[float] = []

    def run() -> None:
        body = GOOD | {"max_tokens": 600, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60.0) as r:
            times.extend(time.monotonic() for line in r.iter_lines() if line.startswith("data: "))
    streaming = threading.Thread(target=run)
    streaming.start()
    time.sleep(0.5)
    sized = post(server, "/v1/completions", big)
    chunked = httpx.post(f"{server.url}/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)),
                         headers={"content-type": "application/json"}, timeout=60.0)
    refused_at = time.monotonic()
    streaming.join(60)
    for reply in (sized, chunked):
        assert_error(reply, 413, None, "request_too_large", ["at most 1048576", "--max-body-bytes"])
    assert times and times[-1] > refused_at, "the stream ended before the 413s: it measured nothing"
    gap = max(b - a for a, b in zip(times, times[1:]))
    print(f"the stream's longest gap between chunks: {gap * 1000:.0f} ms over {len(times)} chunks")
    assert gap < 2.0
    server.report = server.wait_idle()          # one more finished request: the baseline of the tests after


def test_after_the_bad_requests_the_server_is_as_it_was(server):
    """Run last: the server is healthy, owns nothing, and a greedy request gives the same text as before."""
    assert httpx.get(f"{server.url}/health", timeout=10.0).status_code == 200
    report = server.integrity()
    assert report["idle"] and report["problems"] is None, report
    assert report["free_pages"] == report["usable_pages"] and report["free_rows"] == report["max_running"], report
    assert greedy_text(server) == server.greedy
