"""certrag serve's limits: its settings (ServeConfig), its Prometheus metrics, the gates that bound what is in
flight (429 with Retry-After when full), and the outer ASGI guard (the API key, the body limit counted on the bytes
read, slow clients dropped, each request's latency)."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from dataclasses import dataclass

from certrag.llm.calls import Cancelled
from certrag.serve.protocol import ApiError, error_body

OPEN_ROUTES = ("/", "/health", "/ready")  # exact paths, open without the API key (the page asks for the key)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """host: bind address (loopback unless told otherwise); max_body_bytes: request bodies over this get 413;
    max_batch / max_wait_ms: the encoders' dynamic batchers; queue_depth: generations queued or running at once
    (more get 429); encoder_depth: retrieve / rerank / embeddings requests in flight at once (more get 429);
    rerank_instances: cross-encoder instances over the same weights, each on its share of the torch threads, that
    score queued pairs side by side (a request's pairs are shared among the idle ones);
    timeout_s: the default per-request deadline (a request may ask for less with its `timeout` field or an
    X-Request-Timeout header), after which it gets 504 and its work stops; read_timeout_s: a client that takes
    longer to send a request's head, or between the pieces of its body, is dropped (the body: 408); api_key: when
    set, every route but /,
    /health and /ready needs `Authorization: Bearer <key>`."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_batch: int = 64
    max_wait_ms: float = 2.0
    queue_depth: int = 16
    encoder_depth: int = 32
    rerank_instances: int = 1
    timeout_s: float = 120.0
    read_timeout_s: float = 10.0
    api_key: str | None = None
    serialize: bool = False  # a baseline for benchmarks only: one request at a time, as the server used to run

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_batch", "queue_depth", "encoder_depth", "rerank_instances"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer from 0 to 65535; got {self.port!r}")
        if not (isinstance(self.read_timeout_s, (int, float)) and 0 < self.read_timeout_s <= 3600):
            raise ValueError(f"read_timeout_s must be between 0 and 3600 seconds; got {self.read_timeout_s!r}")
        if not (isinstance(self.max_wait_ms, (int, float)) and 0 <= self.max_wait_ms <= 1000):
            raise ValueError(f"max_wait_ms must be between 0 and 1000; got {self.max_wait_ms!r}")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 86400):
            raise ValueError(f"timeout_s must be positive; got {self.timeout_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")


class Metrics:
    """Prometheus metrics in the app's own registry."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram("certrag_request_seconds", "request latency by route and status",
                                 ["route", "status"], buckets=buckets, registry=self.registry)
        self.stage = Histogram("certrag_stage_seconds", "time in each stage of a request",
                               ["stage"], buckets=buckets, registry=self.registry)
        self.batch = Histogram("certrag_batch_items", "items per dynamic-batcher run", ["model"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.batch_requests = Histogram("certrag_batch_requests", "requests per dynamic-batcher run", ["model"],
                                        buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.queue = Gauge("certrag_generation_queue", "generations queued or running", registry=self.registry)
        self.encoder_requests = Gauge("certrag_encoder_requests", "retrieve / rerank / embeddings requests in flight",
                                      registry=self.registry)
        self.tokens = Counter("certrag_tokens_total", "tokens in and out of the model", ["kind"],
                              registry=self.registry)
        self.rejected = Counter("certrag_rejected_total", "requests refused", ["reason"], registry=self.registry)

    def on_batch(self, model: str, items: int, requests: int) -> None:
        self.batch.labels(model).observe(items)
        self.batch_requests.labels(model).observe(requests)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Gate:
    """At most `depth` requests of one kind in flight; the next gets 429 with Retry-After, so a burst costs a
    refusal, never an unbounded queue."""

    def __init__(self, depth: int, what: str, gauge, rejected) -> None:
        self.depth = depth
        self.what = what
        self._gauge = gauge
        self._rejected = rejected
        self._count = 0
        self._count_lock = threading.Lock()

    @property
    def count(self) -> int:
        """Requests admitted and not yet released."""
        return self._count

    def admit(self) -> None:
        with self._count_lock:
            if self._count >= self.depth:
                self._rejected.labels("queue_full").inc()
                raise ApiError(429, f"{self.what} is full ({self.depth} in flight); retry later",
                               kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self._count += 1
            self._gauge.set(self._count)

    def release(self) -> None:
        with self._count_lock:
            self._count -= 1
            self._gauge.set(self._count)

    def __enter__(self) -> "Gate":
        self.admit()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def releasing(fn, gate: Gate):
    """fn as a call that gives its admitted place in gate back when it ends, however it ends."""
    def call():
        try:
            return fn()
        finally:
            gate.release()

    return call


class GenerationQueue(Gate):
    """At most `depth` generations admitted (queued in the model's engine or running); the next gets 429. There is
    no model lock: a LocalLLM's decode engine batches concurrent generations into shared decode steps, and a remote
    model serves its own concurrency. A request whose cancel event is set before it starts does not start."""

    def __init__(self, depth: int, metrics: Metrics) -> None:
        super().__init__(depth, "the generation queue", metrics.queue, metrics.rejected)

    def run(self, fn, cancel: threading.Event):
        """fn() now, on the calling thread; raises Cancelled when already cancelled."""
        if cancel.is_set():
            raise Cancelled()
        return fn()


class Guard:
    """The outer ASGI layer: the API key, the body limit counted on the bytes actually read (a declared
    Content-Length over the limit is refused before reading; a chunked body as soon as it passes the limit), and
    each request's latency by route and status."""

    def __init__(self, app, *, config: ServeConfig, metrics: Metrics, routes: set[str]) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        self.routes = routes  # the app's paths: latency is labelled by route, anything else is "other"
        self.one_at_a_time = asyncio.Lock() if config.serialize else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, metrics, path = self.config, self.metrics, scope["path"]
        started = time.perf_counter()
        status = {"code": 500, "sent": False, "refused": False}

        async def send_counted(message):
            if status["refused"]:
                return  # the guard has answered 413 already: the app's own reply goes nowhere
            if message["type"] == "http.response.start":
                status["code"], status["sent"] = message["status"], True
            await send(message)

        async def reply(code: int, message: str, kind: str, headers: dict | None = None):
            body = json.dumps(error_body(path, code, message, kind, None, None)).encode()
            hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
            await send_counted({"type": "http.response.start", "status": code, "headers": hdrs})
            await send_counted({"type": "http.response.body", "body": body})

        try:
            headers = dict(scope.get("headers") or [])
            if config.api_key and path not in OPEN_ROUTES:
                auth = headers.get(b"authorization", b"").decode("latin-1")
                if not _same(auth, f"Bearer {config.api_key}"):
                    metrics.rejected.labels("unauthorized").inc()
                    return await reply(401, "a valid API key is required (Authorization: Bearer <key>)",
                                       "authentication_error", {"WWW-Authenticate": "Bearer"})
            declared = headers.get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
                metrics.rejected.labels("too_large").inc()
                return await reply(413, f"request body over {config.max_body_bytes} bytes", "invalid_request_error")
            seen, body_done = 0, False

            async def counted_receive():
                # over the limit: answer 413 now and tell the app the client has gone, so it stops reading; a body
                # whose next piece takes longer than read_timeout_s: 408 (after the body, receive() waits for the
                # client to leave, and no limit applies)
                nonlocal seen, body_done
                if status["refused"]:
                    return {"type": "http.disconnect"}
                if body_done:
                    message = await receive()
                else:
                    try:
                        message = await asyncio.wait_for(receive(), timeout=config.read_timeout_s)
                    except asyncio.TimeoutError:
                        metrics.rejected.labels("slow_client").inc()
                        if not status["sent"]:
                            await reply(408, f"the request body did not arrive within {config.read_timeout_s:g} s",
                                        "invalid_request_error", {"Connection": "close"})
                        status["refused"] = True
                        return {"type": "http.disconnect"}
                if message["type"] == "http.request":
                    body_done = not message.get("more_body", False)
                    seen += len(message.get("body", b""))
                    if seen > config.max_body_bytes:
                        metrics.rejected.labels("too_large").inc()
                        if not status["sent"]:
                            await reply(413, f"request body over {config.max_body_bytes} bytes",
                                        "invalid_request_error")
                        status["refused"] = True
                        return {"type": "http.disconnect"}
                return message

            if self.one_at_a_time is not None:
                async with self.one_at_a_time:
                    await self.app(scope, counted_receive, send_counted)
            else:
                await self.app(scope, counted_receive, send_counted)
        finally:
            route = path if path in self.routes else "other"
            metrics.latency.labels(route, str(status["code"])).observe(time.perf_counter() - started)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))
