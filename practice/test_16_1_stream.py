# >>> ch16 file: the judge's own test of exercise 16.1
"""Exercise 16.1, judged on the generator alone: stream() turns a request's Tokens messages into
server-sent events, and a client that leaves aborts what still runs.

No server and no engine run here. The engine's side is a queue of messages the test fills and a fake
client that records the ids it is asked to abort; the client's side reads the events, and leaves by
cancelling its read where it waits, as sse-starlette cancels the generator when the connection closes.
Each choice's text comes from the tiny checkpoint's tokenizer, as the server's does.

    python practice/judge.py test 16.1
"""

from __future__ import annotations

import asyncio
import inspect
import json

from minioverlap.model.loader import SHIPPED, load_tokenizer
from minioverlap.server.api import stream
from minioverlap.server.client import EngineGone
from minioverlap.server.messages import Tokens
from minioverlap.server.responses import Choice, Choices, Completion
from minioverlap.text import TextStream

TOKENIZER = load_tokenizer(SHIPPED["tiny"])
RIDS = (10, 11)


class Engine:
    """The engine's client as stream() sees it: it only aborts."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)


def tokens(rid: int, ids: list[int], finish_reason: str | None = None) -> Tokens:
    return Tokens(rid, ids, finish_reason is not None, finish_reason, None)


def setup(messages: list, include_usage: bool = False):
    """The engine, the generator over a queue holding `messages`, and the choices of RIDS."""
    engine, queue = Engine(), asyncio.Queue()
    for msg in messages:
        queue.put_nowait(msg)
    choices = Choices([Choice(i, rid, TextStream(TOKENIZER)) for i, rid in enumerate(RIDS)])
    events = stream(engine, queue, choices, Completion("tiny", lambda t: TOKENIZER.decode([t])), include_usage)
    return engine, events


async def started(events):
    """The generator itself; a coroutine (the stub's stream, with no yield in it) is awaited for its
    error, as the server does (api.sse)."""
    if inspect.iscoroutine(events):
        await events
        raise TypeError("stream() must be an async generator: it yields the events")
    return events


async def read_all(events) -> list[str]:
    return [event async for event in await started(events)]


async def leave_after(events, n: int) -> list[str]:
    """The client reads n events (or every one, if fewer come), then leaves while the generator waits."""
    events, got = await started(events), []

    async def read() -> None:
        async for event in events:
            got.append(event)

    task = asyncio.create_task(read())
    while len(got) < n and not task.done():
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)                   # the generator is at its next `await queue.get()`
    assert not task.done(), f"the stream ended by itself after {got}: nothing was left for the client to leave"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return got


def chunks(events: list[str]) -> list[dict]:
    return [json.loads(e) for e in events if e != "[DONE]"]


def test_a_stream_gives_a_chunk_per_message_each_choice_s_text_then_done():
    """Two choices, two messages each: four chunks, each for its choice (index), the last of each with its
    finish_reason; the usage chunk when asked for; then [DONE]. Each choice's text is its tokens' text.
    Nothing is aborted: both requests finished."""
    hello, world = TOKENIZER.encode("def fibonacci(n):").ids, TOKENIZER.encode("class Stack:").ids
    engine, events = setup([tokens(10, hello[:2]), tokens(11, world[:1]), tokens(11, world[1:], "stop"),
                            tokens(10, hello[2:], "length")], include_usage=True)
    got = asyncio.run(read_all(events))
    assert got[-1] == "[DONE]"
    body = chunks(got)
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in body[:4]] == [
        (0, None), (1, None), (1, "stop"), (0, "length")]
    for index, ids in ((0, hello), (1, world)):
        assert "".join(c["choices"][0]["text"] for c in body[:4] if c["choices"][0]["index"] == index) == \
            TOKENIZER.decode(ids)
    assert body[4]["usage"]["completion_tokens"] == len(hello) + len(world) and len(body) == 5
    assert engine.aborted == []


def test_a_client_that_leaves_aborts_its_requests_still_running():
    """Choice 1 finishes, choice 0 has one chunk out when the client leaves: request 10 is aborted, and
    only it (11 has ended)."""
    engine, events = setup([tokens(10, [5]), tokens(11, [6], "stop")])
    got = asyncio.run(leave_after(events, 2))
    assert len(chunks(got)) == 2
    assert engine.aborted == [10]


def test_a_queued_request_whose_client_leaves_is_aborted():
    """No token has come yet (the requests wait in the engine's queue) when the client leaves: both are
    aborted, or they would run later for nobody."""
    engine, events = setup([])
    asyncio.run(leave_after(events, 0))
    assert sorted(engine.aborted) == list(RIDS)


def test_abort_all_gives_each_choice_its_last_chunk_with_finish_reason_abort():
    """An abort from elsewhere (/abort, abort_all) ends each request with a last message, finish_reason
    'abort': each is sent as its choice's last chunk, then [DONE]; the generator aborts nothing more."""
    engine, events = setup([tokens(10, [5]), tokens(10, [], "abort"), tokens(11, [], "abort")])
    got = asyncio.run(read_all(events))
    assert got[-1] == "[DONE]"
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks(got)] == [
        (0, None), (0, "abort"), (1, "abort")]
    assert engine.aborted == []


def test_an_engine_that_stops_ends_the_stream_with_an_error_event():
    """The engine is gone (EngineGone in the queue): the stream's last event before [DONE] is an error
    body naming it, no chunk comes after it, and the requests still running are aborted."""
    engine, events = setup([tokens(10, [5]), EngineGone("the engine has stopped"), tokens(11, [6], "stop")])
    got = [e for e in asyncio.run(read_all(events)) if e != "[DONE]"]
    assert len(got) == 2 and "the engine has stopped" in json.loads(got[-1])["error"]["message"]
    assert sorted(engine.aborted) == list(RIDS)
