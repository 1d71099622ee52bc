# >>> ch16 file: load and faults against one server
"""Chapter 16: one server under load and faults, in each loop (normal, overlap, overlap with MTP).

Many clients at once, streaming or not; some leave in the middle of a request, some abort theirs with
POST /abort, and one client process is killed with 16 streams open. Every request ends: the ones left
or aborted are aborted in the engine (its count of finishes says so), the others end with "stop" or
"length". Afterwards the engine owns nothing (every page and request slot free, the integrity check
silent), and greedy requests give the text that a plain LLM gives.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

from conftest import CODE_PROMPTS
from minioverlap.llm import LLM
from minioverlap.sampling_params import SamplingParams
from serving import Server

pytestmark = pytest.mark.process

MODEL = "tiny"
FRESH = CODE_PROMPTS[:3]
LONG = 960           # max_tokens (ignore_eos) of a request its client leaves or aborts: it cannot end first
LOAD_S = 90.0        # the whole load must end within this; any one request within REQUEST_S
REQUEST_S = 60.0


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """The greedy text of each FRESH prompt from a plain LLM, in this process."""
    return [o.text for o in LLM(MODEL).generate(FRESH, SamplingParams(max_tokens=16))]


@pytest.fixture(scope="module", params=[("--loop", "normal"), ("--loop", "overlap"), ("--loop", "overlap", "--mtp", "2")],
                ids=["normal", "overlap", "overlap-mtp2"])
def server(request):
    server = Server(*request.param)
    try:
        yield server
    finally:
        code, out = server.stop()
    assert code == 0, f"the server exited with {code} after SIGTERM:\n{out}"


def assert_owns_nothing(server: Server) -> dict:
    """Once idle: no integrity problem, every page and request slot free. The report."""
    report = server.wait_idle()
    assert report["problems"] is None, report
    assert report["free_pages"] == report["usable_pages"], report
    assert report["free_rows"] == report["max_running"], report
    return report


def assert_greedy_as_reference(server: Server, reference: list[str]) -> None:
    texts = []
    for prompt in FRESH:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60.0,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    assert texts == reference


def grown(before: dict, after: dict) -> dict[str, int]:
    """How many requests ended, by finish_reason, between two integrity reports."""
    reasons = set(before["finishes"]) | set(after["finishes"])
    return {r: after["finishes"].get(r, 0) - before["finishes"].get(r, 0) for r in reasons}


# ---- the load: what each request does, planned from one seed
@dataclass
class Plan:
    i: int
    kind: str            # "complete", "leave" (the client goes away) or "abort" (POST /abort after 1 event)
    stream: bool
    max_tokens: int
    temperature: float
    reads: int           # a stream that leaves: the events read first (0: it leaves before its first token)

    def body(self) -> dict:
        body = {"model": MODEL, "prompt": f"{CODE_PROMPTS[self.i % len(CODE_PROMPTS)]} # {self.i}",
                "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.i, "stream": self.stream}
        return body | ({"ignore_eos": True} if self.kind != "complete" else {})


def plans(n: int, seed: int = 0) -> list[Plan]:
    """A quarter leave (a stream after 0 to 3 events: 0 is a request still waiting for its first token;
    a plain request by its timeout), a tenth abort (streams), the rest complete (4-24 tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        draw = rng.random()
        kind = "leave" if draw < 0.25 else "abort" if draw < 0.35 else "complete"
        stream = kind == "abort" or rng.random() < 0.5
        max_tokens = rng.randint(4, 24) if kind == "complete" else LONG
        out.append(Plan(i, kind, stream, max_tokens, rng.choice([0.0, 0.8]), rng.randint(0, 3)))
    return out


async def run(client: httpx.AsyncClient, url: str, plan: Plan) -> str:
    """Carry out one plan: its finish_reason, or "left"."""
    if not plan.stream:
        try:
            reply = await client.post(f"{url}/v1/completions", json=plan.body(),
                                      timeout=0.2 if plan.kind == "leave" else REQUEST_S)
        except httpx.TimeoutException:
            assert plan.kind == "leave", f"request {plan} timed out"
            return "left"
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["finish_reason"]
    chunks = []
    async with client.stream("POST", f"{url}/v1/completions", json=plan.body(), timeout=REQUEST_S) as reply:
        assert reply.status_code == 200, await reply.aread()
        if plan.kind == "leave" and plan.reads == 0:
            return "left"                                    # leaves as soon as the request is accepted
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunks.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if plan.kind == "leave" and len(chunks) == plan.reads:
                return "left"                                # closing the stream unread closes the connection
            if plan.kind == "abort" and len(chunks) == 1:
                answer = await client.post(f"{url}/abort", json={"id": chunks[0]["id"]}, timeout=REQUEST_S)
                assert answer.json() == {"aborted": 1}, answer.text
    assert chunks[-1] == "[DONE]" and all(c["id"] == chunks[0]["id"] for c in chunks[:-1]), chunks
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert all(r is None for r in reasons[:-1]), reasons        # only the last chunk has a finish_reason
    return reasons[-1]


async def load(url: str, todo: list[Plan], clients: int) -> list[str]:
    """`clients` clients at once, each carrying out its share of the plans in turn; every request bounded."""
    results: dict[int, str] = {}

    async def one_client(mine: list[Plan]) -> None:
        for plan in mine:
            try:
                results[plan.i] = await asyncio.wait_for(run(client, url, plan), REQUEST_S)
            except asyncio.TimeoutError:
                raise AssertionError(f"request {plan} did not end within {REQUEST_S} s") from None

    limits = httpx.Limits(max_connections=4 * clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.create_task(one_client(todo[c::clients])) for c in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=LOAD_S, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:                                 # a failure or the time limit: stop the others
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            raise task.exception()
    assert not pending, f"the load did not end within {LOAD_S} s: {len(results)} of {len(todo)} requests ended"
    return [results[plan.i] for plan in todo]


def test_many_clients_that_leave_or_abort_leave_nothing_behind(server, reference):
    """200 requests from 20 clients at once: a quarter leave in the middle, a tenth abort. Each request
    ends as its client meant; the engine aborted every one left or aborted and finished the others; it
    then owns nothing and gives the reference's greedy text."""
    before = server.integrity()
    todo = plans(200)
    start = time.monotonic()
    results = asyncio.run(load(server.url, todo, clients=20))
    for plan, result in zip(todo, results):
        expected = {"complete": {"stop", "length"}, "leave": {"left"}, "abort": {"abort"}}[plan.kind]
        assert result in expected, (plan, result)
    ended = grown(before, assert_owns_nothing(server))
    gone, complete = sum(plan.kind != "complete" for plan in todo), sum(plan.kind == "complete" for plan in todo)
    assert ended.get("abort", 0) >= gone, f"{gone} requests were left or aborted, the engine aborted {ended}"
    assert ended.get("stop", 0) + ended.get("length", 0) == complete, f"{complete} requests completed: {ended}"
    assert_greedy_as_reference(server, reference)
    print(f"{len(todo)} requests in {time.monotonic() - start:.1f} s; the engine's finishes: {ended}")


CLIENT = """
import sys, threading, httpx
url, n = sys.argv[1], int(sys.argv[2])
body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 900, "ignore_eos": True, "stream": True}
def read():
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for _ in reply.iter_lines():
            pass
threads = [threading.Thread(target=read) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_a_killed_client_process_aborts_its_streams(server, reference):
    """A client process with 16 streams open is killed (SIGKILL) while all 16 run, as SGLang's
    test_abort does: the kernel closes its connections, the server aborts all 16, none runs to its end."""
    before = server.integrity()
    streams = before["max_running"]
    child = subprocess.Popen([sys.executable, "-c", CLIENT, server.url, str(streams)])
    try:
        deadline = time.monotonic() + 60.0
        while server.integrity()["free_rows"] > before["max_running"] - streams:
            assert child.poll() is None, f"the client exited with {child.returncode} before its requests ran"
            assert time.monotonic() < deadline, f"the {streams} requests were not all running within 60 s"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    ended = grown(before, assert_owns_nothing(server))
    assert ended.get("abort", 0) == streams and ended.get("length", 0) == 0, ended
    assert_greedy_as_reference(server, reference)
