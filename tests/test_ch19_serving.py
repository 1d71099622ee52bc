"""Chapter 19 on the server: OpenAI's `response_format` (text, json_object, json_schema) and SGLang's `regex`,
sent by the official `openai` client as a real client sends them, on /v1/completions and /v1/chat/completions.
The tiny model's greedy output under a schema parses and validates, whole or streamed, for each of n choices;
under a regex it matches whole; under json_object it is a JSON object. A schema or regex xgrammar cannot
compile, a response_format that is malformed, and a regex beside a JSON format are each a 400 naming the
field; the server then serves as before and holds nothing. Two servers: the overlap loop, and the normal loop
with MTP."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.serving import Server

pytestmark = pytest.mark.process

SERVERS = {"overlap": ["--loop", "overlap"], "normal-mtp3": ["--loop", "normal", "--mtp", "3"]}
MODEL = "tiny"
TIMEOUT = 30.0                  # seconds any one request may take
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS = {
    "typed-object": {"type": "object", "required": ["name", "age"],
                     "properties": {"name": {"type": "string", "maxLength": 12},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "enum": {"enum": ["red", "green", "blue"]},
    "int-array": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
}
PHONE = r"\d{3}-\d{4}"


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name]}}


@pytest.fixture(scope="module", params=SERVERS)
def server(request):
    s = Server(*SERVERS[request.param], "--max-running", "4")
    try:
        yield s
    finally:
        code, out = s.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def complete(client: openai.OpenAI, **fields):
    return client.completions.create(model=MODEL, prompt=PROMPT, **({"max_tokens": 64, "temperature": 0} | fields))


def chat(client: openai.OpenAI, **fields):
    return client.chat.completions.create(model=MODEL, messages=CHAT, **({"max_tokens": 64, "temperature": 0} | fields))


def assert_valid(text: str, name: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("name", SCHEMAS)
def test_a_completion_follows_its_schema(client, name):
    [choice] = complete(client, extra_body={"response_format": schema_format(name)}).choices
    assert choice.finish_reason == "stop", choice
    assert_valid(choice.text, name)


@pytest.mark.parametrize("name", SCHEMAS)
def test_a_chat_reply_follows_its_schema(client, name):
    [choice] = chat(client, response_format=schema_format(name)).choices
    assert choice.finish_reason == "stop", choice
    assert_valid(choice.message.content, name)


def test_json_object_gives_a_json_object(client):
    [choice] = chat(client, response_format={"type": "json_object"}).choices
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict), choice
    [choice] = complete(client, extra_body={"response_format": {"type": "json_object"}}).choices
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict), choice


def test_text_format_is_no_grammar(client):
    """response_format text is the output a request without one gets."""
    free = complete(client, max_tokens=16).choices[0].text
    assert complete(client, max_tokens=16, extra_body={"response_format": {"type": "text"}}).choices[0].text == free


def test_a_stream_follows_its_schema(client):
    """The deltas of a stream under a schema add up to JSON that validates."""
    chunks = list(chat(client, response_format=schema_format("typed-object"), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert_valid(text, "typed-object")
    chunks = list(complete(client, extra_body={"response_format": schema_format("int-array")}, stream=True))
    assert_valid("".join(c.choices[0].text for c in chunks if c.choices), "int-array")


def test_a_regex_is_matched_whole(client):
    [choice] = complete(client, extra_body={"regex": PHONE}).choices
    assert re.fullmatch(PHONE, choice.text) and choice.finish_reason == "stop", choice
    [choice] = chat(client, extra_body={"regex": PHONE}).choices
    assert re.fullmatch(PHONE, choice.message.content) and choice.finish_reason == "stop", choice


def test_each_of_n_choices_follows_the_schema(client):
    """n=2, sampled (seeded): each choice is a request of its own, each with its own matcher."""
    out = chat(client, response_format=schema_format("typed-object"), n=2, temperature=0.8, seed=1)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert_valid(choice.message.content, "typed-object")


BAD = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}
ERRORS = [  # (endpoint, the fields, param, code, words the message holds)
    pytest.param("chat", {"response_format": BAD}, "response_format.json_schema.schema", "invalid_value",
                 ["response_format.json_schema.schema must be a JSON schema that xgrammar compiles",
                  '{"type": "integer", "minimum": 5', "minimum greater than maximum"], id="schema-min-over-max"),
    pytest.param("completions", {"response_format": BAD | {"json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}},
                 "response_format.json_schema.schema", "invalid_value", ['Unsupported type "nonsense"'],
                 id="schema-unknown-type"),
    pytest.param("completions", {"regex": "("}, "regex", "invalid_value",
                 ['regex must be a regular expression that xgrammar compiles, got "("', "parenthesis"],
                 id="regex-unclosed"),
    pytest.param("chat", {"regex": ""}, "regex", "invalid_value", ["non-empty"], id="regex-empty"),
    pytest.param("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
                 "missing_required_parameter", ["required"], id="json_schema-missing"),
    pytest.param("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
                 "response_format.json_schema.schema", "invalid_type", ["an object", "[1]"], id="schema-not-object"),
    pytest.param("chat", {"response_format": {"type": "yaml"}}, "response_format", "invalid_value",
                 ["'json_schema'", '"yaml"'], id="unknown-type"),
    pytest.param("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema",
                 "unrecognized_argument", ["Unrecognized"], id="unknown-field"),
    pytest.param("completions", {"regex": PHONE, "response_format": {"type": "json_object"}}, "regex", "invalid_value",
                 ["regex", "response_format", "json_object"], id="regex-with-json_object"),
]


@pytest.mark.parametrize("endpoint, fields, param, code, words", ERRORS)
def test_a_bad_grammar_is_a_400_naming_its_field(client, endpoint, fields, param, code, words):
    with pytest.raises(openai.BadRequestError) as caught:
        (chat if endpoint == "chat" else complete)(client, extra_body=fields)
    err = caught.value.body
    assert caught.value.status_code == 400 and (err["param"], err["code"]) == (param, code), err
    for word in words:
        assert word in err["message"], err["message"]


def test_after_the_bad_grammars_the_server_serves_and_holds_nothing(server, client):
    """Run last: a request with a grammar and one without still succeed; the engine is idle, holds
    nothing, and counts no request that failed."""
    assert_valid(complete(client, extra_body={"response_format": schema_format("enum")}).choices[0].text, "enum")
    assert complete(client, max_tokens=8).choices[0].finish_reason == "length"
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    report = server.wait_idle(TIMEOUT)
    assert report["problems"] is None, report
    assert report["free_pages"] == report["usable_pages"] and report["free_rows"] == report["max_running"], report
    assert "error" not in report["finishes"], report
