"""Chapter 16: the server on FastAPI. The routes take pydantic models, so FastAPI validates every body and
/openapi.json lists every field; a body the models refuse (RequestValidationError, FastAPI's 422) is a 400
in OpenAI's error body naming the field, as OpenAI, vLLM and SGLang answer it. Response ids are unique
across starts; the fields SGLang's and vLLM's clients send reach SamplingParams; /metrics counts exactly
the requests and tokens served; every request is a line of the access log.

The tests without a server build the app around an engine that is never reached (a bad body never gets
there); the others share one server on 127.0.0.1, and bound their requests in number and time.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from minioverlap.server.api import Served, create_app
from minioverlap.server.protocol import (AbortRequest, APIError, ChatRequest, CompletionRequest, Message,
                                         StreamOptions, chat_request, completion_request, sampling_params)
from serving import Server

MODEL = "tiny"
TIMEOUT = 60.0                   # seconds any one request may take
GOOD = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def app_client():
    """The app around an engine no test reaches: every body here is refused before it."""
    engine = SimpleNamespace(start=lambda loop: None, stop=lambda: None, alive=True)
    app = create_app(engine, Served(MODEL, SimpleNamespace(max_seq_len=1024), SimpleNamespace(template=None)))
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def assert_openai_error(reply: httpx.Response, param: str | None, code: str, *words: str) -> dict:
    """Status 400 (not FastAPI's 422) and OpenAI's body: exactly its four keys, the field dotted."""
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize("payload, param, code, words", [
    pytest.param(GOOD | {"temperature": "hot"}, "temperature", "invalid_type", ['"hot"'], id="wrong-type"),
    pytest.param({"model": MODEL, "max_tokens": 4}, "prompt", "missing_required_parameter", ["required"],
                 id="missing-field"),
    pytest.param(GOOD | {"frobnicate": 1}, "frobnicate", "unrecognized_argument",
                 ["Unrecognized request argument supplied: frobnicate"], id="unknown-field"),
    pytest.param(GOOD | {"stream_options": {"include_usage": 1}, "stream": True}, "stream_options.include_usage",
                 "invalid_type", ["boolean"], id="nested-field-dotted"),
    pytest.param(GOOD | {"stop": [""]}, "stop", "invalid_value", ["non-empty", '[""]'], id="empty-stop-string"),
    pytest.param(GOOD | {"stop": ["\n", ""]}, "stop", "invalid_value", ["non-empty"], id="empty-stop-among-others"),
    pytest.param(GOOD | {"min_tokens": 1.5}, "min_tokens", "invalid_type", ["integer"], id="min_tokens-float"),
    pytest.param(GOOD | {"skip_special_tokens": "no"}, "skip_special_tokens", "invalid_type", ["boolean"],
                 id="skip_special_tokens-text"),
])
def test_fastapi_validates_the_body_and_answers_400_in_openais_shape(app_client, payload, param, code, words):
    """FastAPI validates the route's model; its RequestValidationError handler answers in OpenAI's shape."""
    assert_openai_error(app_client.post("/v1/completions", json=payload), param, code, *words)


def test_a_chat_body_and_an_abort_body_are_validated_too(app_client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "mood": "good"}]}
    assert_openai_error(app_client.post("/v1/chat/completions", json=chat), "messages[0].mood", "unrecognized_argument")
    assert_openai_error(app_client.post("/abort", json={"id": 7}), "id", "invalid_type", "a string")
    assert_openai_error(app_client.post("/abort", json={}), "id", "invalid_value", '{"all": true}')


def test_a_body_is_json_whatever_its_content_type(app_client):
    """curl -d sends a form's Content-Type: the body is still read as JSON (its error names the field), and
    JSON that Python's parser would let through (a lone surrogate) is refused as not JSON."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    reply = app_client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "top_k": 0}', headers=form)
    assert_openai_error(reply, "top_k", "invalid_value", "got 0")
    reply = app_client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a\\ud800"}',
                            headers={"content-type": "application/json"})
    assert_openai_error(reply, None, "invalid_json", "not valid JSON")


def test_openapi_lists_every_request_field(app_client):
    """/openapi.json holds each model of a body, with every field under its JSON name, and the routes' bodies
    refer to them; the answers and the error body are there too."""
    spec = app_client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for model in (CompletionRequest, ChatRequest, Message, StreamOptions, AbortRequest):
        names = {field.alias or name for name, field in model.model_fields.items()}
        assert names <= set(schemas[model.__name__]["properties"]), (model.__name__, names)
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest"),
                        ("/abort", "AbortRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, (path, body)
    for name in ("CompletionResponse", "ChatCompletionResponse", "ErrorResponse", "ModelList"):
        assert name in schemas, sorted(schemas)


def test_a_chat_limit_past_the_context_names_the_field_sent():
    """max_completion_tokens past the context is reported as max_completion_tokens, not max_tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as caught:
        sampling_params(chat_request(ChatRequest.model_validate(body | {"max_completion_tokens": 2000})), 10, 1024)
    assert caught.value.param == "max_completion_tokens" and caught.value.code == "context_length_exceeded"
    assert caught.value.message.startswith("max_completion_tokens is 2000"), caught.value.message
    with pytest.raises(APIError) as caught:
        sampling_params(chat_request(ChatRequest.model_validate(body | {"max_tokens": 2000})), 10, 1024)
    assert caught.value.param == "max_tokens"


def test_sglang_and_vllm_sampling_fields_reach_sampling_params():
    """min_p, repetition_penalty, min_tokens and skip_special_tokens, under SamplingParams' own names."""
    fields = {"min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 3, "skip_special_tokens": False}
    [params] = sampling_params(completion_request(CompletionRequest.model_validate(GOOD | fields)), 5, 1024)
    assert {name: getattr(params, name) for name in fields} == fields
    [default] = sampling_params(completion_request(CompletionRequest.model_validate(GOOD)), 5, 1024)
    assert (default.min_p, default.repetition_penalty, default.min_tokens, default.skip_special_tokens) == (0.0, 1.0, 0, True)


# ---- with a server
@pytest.fixture(scope="module")
def server():
    server = Server("--max-running", "2")
    try:
        yield server
    finally:
        code, out = server.stop()
    assert code == 0, f"the server exited with {code} after SIGTERM:\n{out}"


def metrics(server: Server) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, its labels sorted): value}."""
    reply = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain"), reply.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


@pytest.mark.process
def test_metrics_count_exactly_the_requests_and_tokens_served(server):
    """Three plain completions and two streams: the request counter moves by 5 on its route and status, the
    token counters by the usage's tokens, TTFT gets one observation a request and ITL one per token after
    a choice's first (a step's message carries one token here); the engine's gauges read idle."""
    server.wait_idle()
    before = metrics(server)
    prompt = completion = 0
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for i in range(3):
            reply = http.post("/v1/completions", json=GOOD | {"max_tokens": 4 + i, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            prompt, completion = prompt + reply.json()["usage"]["prompt_tokens"], completion + 4 + i
        for _ in range(2):
            body = GOOD | {"max_tokens": 5, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: {")]
            usage = httpx.Response(200, content=lines[-1][6:]).json()["usage"]
            prompt, completion = prompt + usage["prompt_tokens"], completion + usage["completion_tokens"]
    assert completion == 4 + 5 + 6 + 2 * 5
    server.wait_idle()
    after = metrics(server)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    assert moved("minioverlap:requests_total", route="/v1/completions", status="200") == 5
    assert moved("minioverlap:prompt_tokens_total") == prompt
    assert moved("minioverlap:generation_tokens_total") == completion
    assert moved("minioverlap:time_to_first_token_seconds_count") == 5
    assert moved("minioverlap:inter_token_latency_seconds_count") == completion - 5
    assert moved("minioverlap:time_to_first_token_seconds_bucket", le="+Inf") == 5
    assert after[("minioverlap:num_running_reqs", ())] == 0 and after[("minioverlap:num_queue_reqs", ())] == 0
    assert after[("minioverlap:pages_used", ())] >= 0


@pytest.mark.process
def test_every_request_is_a_line_of_the_access_log(server):
    """method, path, status and duration, on the server's stderr; an error is logged with its status."""
    marker = f"/v1/nothing-{time.monotonic_ns()}"
    assert httpx.get(f"{server.url}{marker}", timeout=TIMEOUT).status_code == 404
    assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=TIMEOUT).status_code == 200
    pattern = re.compile(r'"POST /v1/completions" 200 \d+\.\d ms$')
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = server.output().splitlines()
        if any(f'"GET {marker}" 404' in line for line in lines) and any(pattern.search(line) for line in lines):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no access-log lines for the two requests:\n{server.output()[-2000:]}")
    after = metrics(server)
    assert after[("minioverlap:requests_total", (("route", "other"), ("status", "404")))] >= 1


@pytest.mark.process
def test_response_ids_are_unique_across_starts(server):
    """OpenAI's ids are unique: cmpl- and a uuid4 in hex, never 1, 2, 3... again after a restart; /abort
    still finds a running request by its id."""
    def ids(url: str) -> list[str]:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            return [http.post("/v1/completions", json=GOOD | {"max_tokens": 1}).json()["id"] for _ in range(2)]
    first = ids(server.url)
    again = Server()
    try:
        second = ids(again.url)
    finally:
        code, out = again.stop()
    assert code == 0, out
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in first + second), first + second
    assert len(set(first + second)) == 4


@pytest.mark.process
def test_abort_finds_a_stream_by_its_response_id(server):
    body = GOOD | {"max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            rid = httpx.Response(200, content=first[6:]).json()["id"]
            assert http.post("/abort", json={"id": rid}).json() == {"aborted": 1}
            events = [line for line in lines if line.startswith("data: ")]
        assert '"finish_reason":"abort"' in events[-2] and events[-1] == "data: [DONE]", events[-2:]
        assert http.post("/abort", json={"id": rid}).json() == {"aborted": 0}        # it has ended
        assert http.post("/abort", json={"id": "cmpl-nothing"}).json() == {"aborted": 0}
