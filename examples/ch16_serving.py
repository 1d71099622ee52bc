"""Chapter 16: a real server, the official openai client, and a client that leaves early.

Run from the repository root:  python examples/ch16_serving.py

It starts `minioverlap serve` (the tiny model, the overlap loop, two request slots) on a free port of
127.0.0.1, streams three completions at once with the `openai` client (one waits in the queue for a
slot), leaves one of them after three chunks, and then asks the server for its integrity report: the
request that was left was aborted, its pages and slot came back, and the server's text for the others
equals a fresh LLM.generate's. One more completion asks for a stop string and logprobs: the engine ends
it on the token that completes the stop string, the text leaves the stop string out, and each token comes
with its log-probability and the two likeliest. Then it stops the server with SIGTERM, as a supervisor
would.
"""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from minioverlap import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n"]


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "minioverlap", "serve", "--port", str(port),
                               "--loop", "overlap", "--max-running", "2"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the server did not come up")


async def complete(client: openai.AsyncOpenAI, prompt: str, leave_after: int | None = None) -> tuple[str, str]:
    """Stream one completion; with `leave_after`, close the stream after that many chunks."""
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    text, reason, chunks = "", None, 0
    async for chunk in stream:
        text, reason, chunks = text + chunk.choices[0].text, chunk.choices[0].finish_reason, chunks + 1
        if chunks == leave_after:
            await stream.close()                     # the client leaves: the server aborts the request
            return text, "left after 3 chunks"
    return text, reason


async def three_streams(url: str) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(complete(client, PROMPTS[0]), complete(client, PROMPTS[1], leave_after=3),
                                    complete(client, PROMPTS[2]))


def stop_and_logprobs(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    stop=["tuples"], logprobs=2).choices[0]
    print(f"\nstop=['tuples']: {out.text!r} ({out.finish_reason}, {len(out.logprobs.tokens)} tokens)")
    for token, logprob, top in list(zip(out.logprobs.tokens, out.logprobs.token_logprobs, out.logprobs.top_logprobs))[:3]:
        likeliest = ", ".join(f"{t!r} {lp:.2f}" for t, lp in top.items())
        print(f"  {token!r:10} logprob {logprob:6.2f}   the two likeliest: {likeliest}")


def main() -> None:
    server, url = start_server()
    try:
        print(f"a server on {url}: the HTTP side in this process's child, the scheduler in a process of its own\n")
        results = asyncio.run(three_streams(url))
        for prompt, (text, how) in zip(PROMPTS, results):
            print(f"{prompt!r:45} -> {text!r:60.60} ({how})")
        while not (report := httpx.get(f"{url}/integrity", timeout=30).json())["idle"]:
            time.sleep(0.1)
        print(f"\nintegrity: problems={report['problems']}, free pages {report['free_pages']}/{report['usable_pages']}, "
              f"free slots {report['free_rows']}/{report['max_running']}, finishes {json.dumps(report['finishes'], sort_keys=True)}")
        fresh = LLM("tiny").generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=24))
        same = [results[0][0], results[2][0]] == [o.text for o in fresh]
        print(f"the two that finished equal a fresh LLM.generate: {same}")
        stop_and_logprobs(url)
    finally:
        server.send_signal(signal.SIGTERM)
        print(f"SIGTERM: the server exited with {server.wait(timeout=30)}")


if __name__ == "__main__":
    main()
