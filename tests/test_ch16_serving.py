# >>> ch16 file: a real server and the official client
"""`minioverlap serve` behind the official `openai` client: the same tokens as LLM.generate, streamed or
whole, text or token-id prompts, chat through the checkpoint's chat template, n choices, stop strings; a client that leaves aborts its request,
running or still queued; SIGTERM and SIGINT stop both processes cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from minioverlap.llm import LLM
from minioverlap.sampling_params import SamplingParams
from tests.conftest import CODE_PROMPTS, TINY
from tests.serving import ROOT, Server, child_env

pytestmark = pytest.mark.process


@pytest.fixture(scope="module", params=["normal", "overlap"])
def server(request):
    s = Server("--loop", request.param, "--max-running", "2")
    yield s
    code, out = s.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference() -> dict:
    """Greedy text of every code prompt from a fresh engine, 24 tokens each."""
    outs = LLM("tiny").generate(CODE_PROMPTS, SamplingParams(max_tokens=24))
    return {p: o for p, o in zip(CODE_PROMPTS, outs)}


def children(pid: int) -> list[int]:
    """The processes `pid` started (Linux: /proc)."""
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(c) for c in open(path).read().split()] if os.path.exists(path) else []


def alive(pid: int) -> bool:
    """A process that runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_completion_equals_llm_generate(client, reference):
    for prompt, expected in reference.items():
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == expected.text
        assert out.choices[0].finish_reason == expected.finish_reason
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_a_stream_equals_llm_generate(client, reference):
    """The deltas of a stream add up to the same text; the last chunk carries the finish_reason, then the usage."""
    prompt, expected = next(iter(reference.items()))
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_a_token_id_prompt(client, reference):
    prompt, expected = next(iter(reference.items()))
    out = client.completions.create(model="tiny", prompt=expected.prompt_token_ids, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text


def test_concurrent_streams_equal_llm_generate(server, reference):
    """More streams than request slots (2): the rest wait in the queue, and every one gets its tokens."""
    import asyncio

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in reference)), 120)

    assert asyncio.run(all_of_them()) == [o.text for o in reference.values()]
    report = server.wait_idle()
    assert report["problems"] is None and report["free_pages"] == report["usable_pages"]


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_leaves_a_stream_aborts_its_requests(server, client, n):
    """A stream of n choices is n requests in the engine: a client that leaves aborts them all."""
    before = server.wait_idle()["finishes"].get("abort", 0)
    stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=1000, temperature=0, n=n,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2 * n:
            break
    stream.close()
    report = server.wait_idle(30)
    assert report["finishes"].get("abort", 0) == before + n
    assert report["problems"] is None
    assert report["free_pages"] == report["usable_pages"] and report["free_rows"] == report["max_running"]


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    """No stream: the handler waits for the last token, watching the connection; the client's timeout
    closes it, and the request is aborted there rather than run to its end."""
    before = server.wait_idle()["finishes"]
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    after = server.wait_idle(30)["finishes"]
    assert after.get("abort", 0) == before.get("abort", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)


def test_a_queued_request_whose_client_leaves_is_aborted(server):
    """Two requests hold both slots; a third waits in the queue and its client leaves before any token
    came: it is aborted there (it never runs), not served to nobody."""
    body = {"model": "tiny", "prompt": "import os\n", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    before = server.wait_idle()["finishes"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as a, http.stream("POST", "/v1/completions", json=body) as b:
            lines = [r.iter_lines() for r in (a, b)]     # kept: an iterator dropped closes its connection
            ids = [json.loads(next(it)[6:])["id"] for it in lines]       # both run: a first chunk each
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"max_tokens": 30}, timeout=60):
                pass                         # its headers came: the engine accepted it, and it waits for a slot
            aborted = sum(http.post("/abort", json={"id": rid}).json()["aborted"] for rid in ids)   # if not done
    after = server.wait_idle(30)["finishes"]
    assert after.get("abort", 0) - before.get("abort", 0) == aborted + 1
    assert after.get("length", 0) - before.get("length", 0) == 2 - aborted      # the queued one never ran


def test_abort_all(server):
    body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            assert http.post("/abort", json={"all": True}).json() == {"aborted": 1}
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert server.wait_idle()["problems"] is None


def test_the_engine_is_as_good_as_new_after_clients_left(client, reference):
    prompt, expected = list(reference.items())[-1]
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text \
        == expected.text


def test_chat_renders_the_checkpoints_template_and_streams(client):
    """The tiny checkpoint's ChatML template (tokenizer_config.json), rendered by transformers: the reply
    is LLM.generate's for the rendered prompt."""
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef fibonacci(n):<|im_end|>\n<|im_start|>assistant\n"
    expected = LLM("tiny").generate(prompt, SamplingParams(max_tokens=16))[0]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "def fibonacci(n):"}]}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, temperature=0)
    assert out.choices[0].message.content == expected.text and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_n_choices_are_n_requests_seeded_seed_plus_i(client):
    """n=3 with seed 7: choice i is what LLM.generate samples with seed 7 + i (vLLM's rule); usage adds up."""
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i) for i in range(3)]
    expected = LLM("tiny").generate(["def f(x):"] * 3, params)
    out = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=1.0, seed=7, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert out.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    chunks = list(client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=1.0, seed=7,
                                            n=3, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)] \
        == [e.text for e in expected]


def test_a_stop_string_ends_the_text_before_it(client, reference):
    """The text ends before the first stop string, which is not sent; finish_reason "stop"."""
    prompt, expected = next((p, e) for p, e in reference.items() if "\n" in e.text.strip("\n"))
    stop = "\n"
    cut = expected.text[:expected.text.index(stop)] if not expected.text.startswith(stop) else ""
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@@"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    word = expected.text.split()[2]                  # a stop string inside the text, across tokens maybe
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=word,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text[:expected.text.index(word)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_come_with_each_token(client):
    out = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == content[0].logprob        # greedy: the chosen is the likeliest


def test_a_model_without_a_chat_template_refuses_chat_with_400(tmp_path):
    """A checkpoint without tokenizer_config.json: a chat request is a 400 that says to use /v1/completions."""
    model = tmp_path / "tiny-no-chat"
    shutil.copytree(TINY, model)
    (model / "tokenizer_config.json").unlink()
    s = Server("--model", str(model))
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert caught.value.body["code"] == "no_chat_template" and "/v1/completions" in caught.value.body["message"]
    finally:
        code, out = s.stop()
    assert code == 0, out


def test_a_busy_port_is_an_error_naming_it_before_anything_loads():
    """The port is bound first: held by another socket, serve exits 2 naming it, and never says "serving"."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "minioverlap", "serve", "--port", str(port)], capture_output=True,
                             text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"127.0.0.1:{port}" in run.stderr and "in use" in run.stderr, run.stderr
    assert "serving" not in run.stdout


def test_a_request_too_large_for_the_pool_is_refused_by_the_scheduler():
    """The pool has 7 usable pages of 16 slots: a request that may need more is refused by the scheduler
    process (the one place that knows the pool) with a 400 naming max_tokens; the server stays up."""
    s = Server("--num-pages", "8")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            c.completions.create(model="tiny", prompt="def f(x):", max_tokens=200)
        assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "too_large_for_the_pool"
        assert "pages" in caught.value.body["message"]
        assert c.completions.create(model="tiny", prompt="def f(x):", max_tokens=8).choices[0].finish_reason
        report = s.wait_idle()
        assert report["problems"] is None and report["free_pages"] == report["usable_pages"] == 7
    finally:
        code, out = s.stop()
    assert code == 0, out


def test_serve_kernels_takes_the_fast_path():
    """--kernels on a CPU: the scheduler process runs chapter 15's kernels (in Triton's interpreter), and a
    completion's tokens are the reference path's."""
    prompt = "def f(x):"
    expected = LLM(model="tiny", kernels=False).generate([prompt], SamplingParams(max_tokens=4))[0]
    s = Server("--kernels", "--max-running", "2")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        assert got.choices[0].text == expected.text
        assert s.wait_idle()["kernels"] is True
    finally:
        code, out = s.stop()
    assert code == 0, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_both_processes_with_a_stream_in_flight(sig):
    """The stream in flight finishes, or ends with an error event if it outlasts the grace period (5 s);
    its body is complete either way; the server exits 0; no process is left."""
    s = Server()
    started = children(s.process.pid)          # the scheduler process (and multiprocessing's resource tracker)
    assert started
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        s.process.send_signal(sig)
        events = [line for line in lines if line.startswith("data: ")]
    code, out = s.stop(timeout_s=30)
    assert code == 0, out
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    time.sleep(0.5)
    assert not [pid for pid in started if alive(pid)], "a process of the server is still there"
