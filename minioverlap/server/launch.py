# >>> ch16 file: the server's processes
"""`minioverlap serve`: the port is bound first (a busy port is an error naming it, before anything
loads); then the scheduler process is started and built (the model loaded, graphs captured); only when it
says Ready does the HTTP side listen on the bound socket, and say so. uvicorn turns SIGINT and SIGTERM
into a graceful shutdown: the port closes, the streams in flight get `grace` seconds to finish, then the
scheduler process is told to stop (it aborts what is left) and is waited for. Nothing is left behind.
Each request answered is a line on stderr (metrics.py's access log): client, method, path, status, duration.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from minioverlap.config import EngineArgs
from minioverlap.model.loader import load_config, load_tokenizer, resolve_model_dir
from minioverlap.processor import Processor
from minioverlap.server.api import Served, create_app
from minioverlap.server.client import EngineClient
from minioverlap.server.engine import run_engine
from minioverlap.server.text import ChatTemplate


BYTES_PER_TOKEN = 64         # the body limit's default: 64 bytes per token of the context, at least 1 MiB


def serve(options: dict, host: str = "127.0.0.1", port: int = 8000, grace: float = 5.0,
          log_level: str = "warning", first_tokens_first: bool = False, max_body_bytes: int | None = None) -> None:
    """Run the server until SIGINT or SIGTERM. `options` are LLM's (EngineArgs' fields): checked here
    first, so that a bad one is a ValueError before any process starts; so is a busy port."""
    model = EngineArgs(**options).model
    model_dir = resolve_model_dir(model)
    sock = bind(host, port)
    engine, process = start_engine(options, first_tokens_first)
    try:
        ready = engine.wait_ready()
        processor = Processor(load_tokenizer(model_dir), model_dir, load_config(model_dir), ready.max_seq_len)
        limit = max_body_bytes or max(1 << 20, BYTES_PER_TOKEN * ready.max_seq_len)
        served = Served(str(model), processor, ChatTemplate(model_dir), limit, grace)
        config = uvicorn.Config(create_app(engine, served), log_level=log_level, timeout_graceful_shutdown=grace + 5)
        print(f"minioverlap: serving {served.name} on http://{host}:{sock.getsockname()[1]}", flush=True)
        access_log()
        with signals_end_the_server():
            GracefulServer(config, engine, grace).run(sockets=[sock])
    finally:
        sock.close()
        engine.stop()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


def access_log() -> None:
    """The access log (the logger of metrics.py) on stderr, a line per request, with the time."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s minioverlap: %(message)s"))
    log = logging.getLogger("minioverlap.access")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it once the engine is ready). A port another
    program holds is a ValueError naming it, before the engine loads."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a port left in TIME_WAIT is free to take
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror} (another server holds port {port}? "
                         "choose another with --port)") from None
    return sock


class GracefulServer(uvicorn.Server):
    """On the first SIGINT or SIGTERM uvicorn closes the port and waits for the open connections; the
    streams still open after `grace` seconds end with an error event (EngineClient.end_all), so none is
    cut off mid-body. uvicorn's own limit, a little longer, is the backstop."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit and self.engine.loop is not None:
            self.engine.loop.call_soon_threadsafe(self.engine.loop.call_later, self.grace, self.engine.end_all)
        super().handle_exit(sig, frame)


@contextmanager
def signals_end_the_server() -> Iterator[None]:
    """uvicorn handles SIGINT and SIGTERM while it serves, and raises the signal again once it has shut
    down, to the handler it found: this one, which lets `serve` return, so that the scheduler process is
    stopped and waited for, and the exit code is 0."""
    handlers = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def start_engine(options: dict, first_tokens_first: bool = False) -> tuple[EngineClient, mp.Process]:
    """The scheduler process (spawned: a fresh interpreter, so CUDA starts cleanly in it) and its pipes.
    The parent closes the child's ends, so that either side sees the other exit as an EOF."""
    ctx = mp.get_context("spawn")
    engine_in, to_engine = ctx.Pipe(duplex=False)           # (the end that reads, the end that writes)
    from_engine, engine_out = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_engine, args=(options, engine_in, engine_out, first_tokens_first),
                          name="minioverlap-scheduler")
    process.start()
    engine_in.close()
    engine_out.close()
    return EngineClient(to_engine, from_engine), process
