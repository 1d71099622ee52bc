# >>> ch16 file: what the server counts: /metrics and the access log
"""What the server counts, for Prometheus (GET /metrics, in its text format, by prometheus_client), and
one access-log line per request.

Named as SGLang (`sglang:`) and vLLM (`vllm:`) name theirs, under `minioverlap:`:
- requests_total{route, status}: the HTTP requests answered (an unknown path counts as route "other");
- prompt_tokens_total, generation_tokens_total: the tokens of the requests served (a request's prompt
  once, however many choices it has, as its usage counts it);
- time_to_first_token_seconds: a histogram, one observation per request, from its arrival to its first
  token; inter_token_latency_seconds: one per message of tokens after a choice's first (an engine step's
  tokens: several with MTP);
- num_running_reqs, num_queue_reqs, pages_used: gauges only the scheduler process knows, asked for with
  the integrity report when /metrics is read;
- cache_hit_rate (chapter 17): prompt tokens served from the prefix cache over all prompt tokens.

The registry is the app's own, not prometheus_client's global one: two apps in one process count apart.
The access log is the logger "minioverlap.access" (launch.py prints it on stderr): client, method, path,
status, duration; a stream's duration runs to its last event.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minioverlap.server.messages import Report, Tokens

log = logging.getLogger("minioverlap.access")
PREFIX = "minioverlap:"
SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    """The server's counters, histograms and gauges, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=SECONDS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between a choice's messages of tokens",
                             buckets=SECONDS, registry=r)
        self.running = Gauge(PREFIX + "num_running_reqs", "Requests running in the engine", registry=r)
        self.queued = Gauge(PREFIX + "num_queue_reqs", "Requests waiting for a slot", registry=r)
        self.pages_used = Gauge(PREFIX + "pages_used", "KV pages in use (of the pool's usable ones)", registry=r)
        self.prompt_sum = 0
        # >>> ch17: the prefix cache's hit rate
        self.cached_sum = 0
        self.hit_rate = Gauge(PREFIX + "cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                              registry=r)
        # <<< ch17

    def scheduler(self, report: Report) -> None:
        """The gauges only the scheduler process knows, from its report."""
        self.running.set(report.running)
        self.queued.set(report.queued)
        self.pages_used.set(report.usable_pages - report.free_pages)
        # >>> ch17: the prefix cache's hit rate
        self.hit_rate.set(self.cached_sum / self.prompt_sum if self.prompt_sum else 0.0)
        # <<< ch17

    def meter(self, prompt_tokens: int) -> Meter:
        """A request the engine accepted: its prompt counted, its times to come."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_sum += prompt_tokens
        return Meter(self)


class Meter:
    """One request's times, observed as its messages of tokens arrive (Choice.take)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.start = metrics, time.monotonic()
        self.first = True                          # no token yet
        self.last: dict[int, float] = {}           # choice index -> when its last message of tokens came

    def took(self, index: int, msg: Tokens) -> None:
        if not msg.token_ids:
            return
        now = time.monotonic()
        self.metrics.generation_tokens.inc(len(msg.token_ids))
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self.first = False
        elif index in self.last:
            self.metrics.itl.observe(now - self.last[index])
        # >>> ch17: the prompt tokens served from the prefix cache, once per request (its first choice's)
        if index == 0 and index not in self.last:
            self.metrics.cached_sum += msg.cached_tokens
        # <<< ch17
        self.last[index] = now


class AccessLog:
    """ASGI middleware: each request counted by route and status, and logged with its duration."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500          # 500: no answer started (an exception, logged there)

        async def sent(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, sent)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(path if path in self.routes else "other", str(status)).inc()
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "-"
            log.info('%s "%s %s" %d %.1f ms', client, scope["method"], path, status,
                     (time.perf_counter() - start) * 1000)
