"""certrag serve: the engine and its models over HTTP.

Routes, each in its ecosystem's format: OpenAI's /v1/chat/completions (streaming as server-sent events ending in
[DONE]), /v1/models and /v1/embeddings, with errors in OpenAI's {"error": {...}} shape; /v1/rerank in the query +
documents format that Cohere, Jina and text-embeddings-inference share; certrag's /v1/retrieve and /v1/answer
(streaming: events for the retrieval, each token and the final answer); /health (alive), /ready (models loaded) and
/metrics (Prometheus text).

Concurrency: no lock spans a request. Retrieval runs in the request's worker thread; the embedder and the reranker
sit behind dynamic batchers (certrag.serve.batching) that gather concurrent requests into shared forward passes.
Generation goes through a bounded queue in front of the model: a request that finds it full gets 429 with
Retry-After, never unbounded memory; a queued or running generation whose client left, or whose deadline passed
(504), stops at its next token. Request bodies are counted as they are read (chunked bodies too): over the limit is
413. Prompts are checked against the model's context before any work (400).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Request  # at module level: the routes' annotations are resolved in this module's namespace
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from certrag.llm.calls import CallView, Cancelled
from certrag.strategies import STRATEGY_NAMES

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/models", "/v1/embeddings")
OPEN_ROUTES = ("/", "/health", "/ready")  # exact paths, open without the API key (the page asks for the key)
STATIC = __import__("pathlib").Path(__file__).resolve().parent / "static"


# ------------------------------------------------------------------------------------------------------ config


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


# ---------------------------------------------------------------------------------------------------- requests


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (a lone surrogate is not)") from None
    return value


Text = Annotated[str, AfterValidator(_text)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatRequest(Strict):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="only 1 is supported")
    user: str | None = None
    timeout: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False,
                                  description="seconds; at most the server's")


class EmbeddingsRequest(Strict):
    model: str = ""
    input: Text | list[Text] = Field(description="a string or a list of strings (token arrays are not supported)")
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class RerankRequest(Strict):
    model: str = ""
    query: Text = Field(min_length=1, max_length=8000)
    documents: list[Text] = Field(min_length=1, max_length=1000)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


class RetrieveRequest(Strict):
    question: Text = Field(min_length=1, max_length=8000)
    candidates: int | None = Field(default=None, ge=1, le=1000)
    rerank: bool | Literal["adaptive"] | None = None
    where: dict[str, str | int | bool | list[str | int | bool]] | None = Field(
        default=None, description="metadata filter: {key: value} or {key: [values]}")
    certify: bool = False
    timeout: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False)


class AnswerRequest(Strict):
    question: Text = Field(min_length=1, max_length=8000)
    strategy: Literal[STRATEGY_NAMES] = "plain"  # certrag.strategies.STRATEGY_NAMES
    qtype: Literal["open", "multiple_choice", "yes_no"] = "open"
    options: list[Text] | None = None
    certify: bool = False  # only chunks trusted under the store's conformal calibration (when it holds)
    confidence: bool = False  # P(supported) from lookback ratios (local model with a factuality classifier)
    max_new_tokens: int | None = Field(default=None, ge=1, le=4096)
    stream: bool = False
    timeout: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False)


# ------------------------------------------------------------------------------------------------------ errors


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """OpenAI's error shape, on the OpenAI routes."""

    error: ErrorDetail


class Detail(BaseModel):
    """certrag's error shape, on its own routes (schema violations keep FastAPI's 422 list)."""

    detail: str


# 499: the client closed the request (nginx's convention); 504: the request's deadline passed
OPENAI_ERRORS = {c: {"model": OpenAIError} for c in (400, 401, 404, 408, 413, 429, 499, 500, 504)}
CERTRAG_ERRORS = {c: {"model": Detail} for c in (400, 401, 404, 408, 413, 429, 499, 500, 504)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


def _error_body(path: str, status: int, message: str, kind: str, param: str | None, code: str | None) -> dict:
    if path.startswith(OPENAI_ROUTES):
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"detail": message}


# ------------------------------------------------------------------------------------------------------ metrics


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


# ------------------------------------------------------------------------------------------------- generation


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


# ------------------------------------------------------------------------------------------------------ the app


def create_app(llm, engine=None, config: ServeConfig | None = None, *, max_body_bytes: int | None = None,
               batch_encoders: bool = True):
    """The ASGI app. llm: a LocalLLM or an OpenAI-compatible client (certrag.llm.OpenAICompatibleLLM); engine: an
    open Engine (read-only is enough) for /v1/embeddings, /v1/rerank, /v1/retrieve and /v1/answer.
    batch_encoders=False leaves the engine's encoders as they are: on Ray Serve they batch in their own deployment
    (@serve.batch), and one batcher thread here would keep all but one of its replicas idle."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    from certrag.serve.batching import BatchingEmbedder, BatchingReranker

    config = config or ServeConfig()
    if max_body_bytes is not None:
        config = ServeConfig(**{**config.__dict__, "max_body_bytes": max_body_bytes})
    metrics = Metrics()
    queue = GenerationQueue(config.queue_depth, metrics)
    encoders = Gate(config.encoder_depth, "the encoder queue", metrics.encoder_requests, metrics.rejected)
    embedder = reranker = None
    if engine is not None and not batch_encoders:
        embedder, reranker = engine._embedder, engine._reranker
    elif engine is not None:
        embedder = BatchingEmbedder(engine._embedder, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                                    on_batch=metrics.on_batch)
        if engine._reranker is not None:
            threads = (None if config.rerank_instances == 1
                       else max(1, engine._reranker._torch.get_num_threads() // config.rerank_instances))
            reranker = BatchingReranker(engine._reranker, max_batch=config.max_batch,
                                        max_wait_ms=config.max_wait_ms, on_batch=metrics.on_batch,
                                        instances=config.rerank_instances, threads=threads)
        engine = engine.serving_view(embedder=embedder, reranker=reranker)
    state = {"ready": llm is not None}

    app = FastAPI(title="certrag", version=__import__("certrag").__version__)
    app.state.metrics = metrics
    app.state.config = config

    app.add_middleware(_Guard, config=config, metrics=metrics)

    # ---- errors ---------------------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(_error_body(request.url.path, exc.status, exc.message, exc.kind, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own (a body that is not JSON: 400; an unknown route: 404), in the route's error shape
        return JSONResponse(_error_body(request.url.path, exc.status_code, str(exc.detail), "invalid_request_error",
                                        None, None), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":  # its loc is the character position, not a parameter
            reason = (first.get("ctx") or {}).get("error")
            where, message = None, (f"the request body is not valid JSON ({reason}) at character "
                                    f"{first.get('loc', (None, '?'))[-1]}" if reason else
                                    "the request body is not valid JSON")
        else:
            message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        if request.url.path.startswith(OPENAI_ROUTES):
            return JSONResponse(_error_body(request.url.path, 400, message, "invalid_request_error", where, None),
                                status_code=400)
        return JSONResponse({"detail": [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg")),
                                         "type": str(e.get("type"))} for e in errors]}, status_code=422)

    # ---- helpers ----------------------------------------------------------------------------------------------

    def deadline(request: Request, asked: float | None) -> float:
        header = request.headers.get("x-request-timeout")
        values = [config.timeout_s]
        if asked is not None:
            values.append(asked)
        if header is not None:
            try:
                h = float(header)
            except ValueError:
                raise ApiError(400, "X-Request-Timeout must be a number of seconds") from None
            if not (math.isfinite(h) and h > 0):
                raise ApiError(400, "X-Request-Timeout must be a positive number of seconds")
            values.append(h)
        return min(values)

    async def run_with_deadline(request: Request, fn, seconds: float, cancel: threading.Event):
        """fn() in a worker thread; 504 after `seconds` and 499-style cancellation when the client leaves. Either
        way the cancel event stops the work at its next token."""
        task = asyncio.ensure_future(run_in_threadpool(fn))
        end = time.monotonic() + seconds
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.1, max(0.0, end - time.monotonic())))
                if done:
                    return task.result()
                if time.monotonic() >= end:
                    cancel.set()
                    metrics.rejected.labels("deadline").inc()
                    raise ApiError(504, f"the request ran past its deadline of {seconds:g} s", kind="timeout",
                                   code="deadline_exceeded")
                if await request.is_disconnected():
                    cancel.set()
                    metrics.rejected.labels("disconnected").inc()
                    raise ApiError(499, "the client closed the request", kind="client_closed")
        except BaseException:
            cancel.set()
            raise

    def check_prompt(messages: list[dict], max_new: int) -> int:
        count = getattr(llm, "prompt_ids", None)
        if count is None:
            return 0
        n = len(count(messages))
        limit = getattr(llm, "context_length", None)
        if limit and n + max_new > limit:
            metrics.rejected.labels("context").inc()
            raise ApiError(400, f"the prompt ({n} tokens) plus max_tokens ({max_new}) exceeds the model's context "
                           f"of {limit} tokens", param="messages", code="context_length_exceeded")
        return n

    def check_request_text(texts: list[str], max_new: int | None) -> None:
        """Before queueing a request whose prompt the engine builds (retrieved passages around the question and its
        options): the question and options alone must leave room in the model's context. The full prompt is
        checked again by the model before any work (PromptTooLong: 400 too)."""
        count, limit = getattr(llm, "count_tokens", None), getattr(llm, "context_length", None)
        if count is None or not limit:
            return
        n = sum(count(t) for t in texts)
        max_new = max_new or 0
        if n + max_new > limit:
            metrics.rejected.labels("context").inc()
            raise ApiError(400, f"the question and its options ({n} tokens) plus max_new_tokens ({max_new}) exceed "
                           f"the model's context of {limit} tokens", param="question",
                           code="context_length_exceeded")

    def need_engine():
        if engine is None:
            raise ApiError(404, "this server has no store: start it with `certrag serve STORE`")

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_from_thread(fn, cancel: threading.Event, seconds: float, on_release):
        """An async iterator of the items fn(emit) emits from a worker thread, then fn's return value (as
        ("done", value)) or its error (("error", exc)). Stops the work when the client leaves or the deadline
        passes."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def emit(item):
            loop.call_soon_threadsafe(items.put_nowait, ("item", item))

        def work():
            try:
                result = fn(emit)
                loop.call_soon_threadsafe(items.put_nowait, ("done", result))
            except BaseException as exc:  # handed to the stream, which reports it
                loop.call_soon_threadsafe(items.put_nowait, ("error", exc))
            finally:
                on_release()

        threading.Thread(target=work, daemon=True, name="certrag-stream").start()

        async def iterate():
            end = time.monotonic() + seconds
            try:
                while True:
                    try:
                        kind, value = await asyncio.wait_for(items.get(), timeout=max(0.01, end - time.monotonic()))
                    except asyncio.TimeoutError:
                        cancel.set()
                        metrics.rejected.labels("deadline").inc()
                        yield ("error", ApiError(504, f"the request ran past its deadline of {seconds:g} s",
                                                 kind="timeout", code="deadline_exceeded"))
                        return
                    yield (kind, value)
                    if kind != "item":
                        return
            finally:  # the client left (the response was cancelled) or the stream ended
                cancel.set()

        return iterate()

    # ---- routes -----------------------------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    def page():
        """A page to ask questions and watch the answer stream in with its evidence (no build step, no CDN)."""
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": dict}})
    def ready():
        ok = state["ready"]
        body = {"ready": ok, "model": getattr(llm, "name", None), "store": str(engine.path) if engine else None,
                "queue": queue._count, "queue_depth": config.queue_depth, "encoder_requests": encoders._count,
                "encoder_depth": config.encoder_depth}
        decode = getattr(llm, "engine", None)  # a local model's decode engine (a remote one reports nothing here)
        if decode is not None:
            running, waiting = decode.load
            body.update(decoding=running, decode_waiting=waiting, decode_batch_max=decode.max_rows)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", responses={**CERTRAG_ERRORS, 200: {"content": {"text/plain": {}},
                                                                 "description": "Prometheus text format"}})
    def metrics_route():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=OPENAI_ERRORS)
    def models() -> dict:
        now = int(time.time())
        data = [{"id": getattr(llm, "name", "llm"), "object": "model", "created": now, "owned_by": "certrag"}]
        if engine is not None:
            data.append({"id": engine.embedder_name, "object": "model", "created": now, "owned_by": "certrag"})
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", responses=OPENAI_ERRORS)
    async def chat(req: ChatRequest, request: Request):
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
        max_new = req.max_completion_tokens or req.max_tokens or 128
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ApiError(400, "stop takes at most 4 non-empty strings", param="stop")
        messages = [m.model_dump() for m in req.messages]
        check_prompt(messages, max_new)
        seconds = deadline(request, req.timeout)
        cancel = threading.Event()
        cid, created, name = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), getattr(llm, "name", req.model)
        kwargs = {"max_new_tokens": max_new, "temperature": req.temperature, "seed": req.seed}
        if stop:
            kwargs["stop"] = stop
        queue.admit()

        def usage(g):
            metrics.tokens.labels("prompt").inc(g.input_tokens)
            metrics.tokens.labels("completion").inc(g.output_tokens)
            return {"prompt_tokens": g.input_tokens, "completion_tokens": g.output_tokens,
                    "total_tokens": g.input_tokens + g.output_tokens}

        def finish_reason(g):
            return "length" if g.finish_reason == "length" else "stop"

        if req.stream:
            def chunk(delta: dict, finish=None, extra=None):
                return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **(extra or {})}

            def work(emit):
                t = time.perf_counter()
                view = CallView(llm, on_text=emit, cancelled=cancel.is_set)
                g = queue.run(lambda: view.generate(messages, **kwargs), cancel)
                metrics.stage.labels("generate").observe(time.perf_counter() - t)
                return g

            events = stream_from_thread(work, cancel, seconds, queue.release)

            async def body():
                yield sse(chunk({"role": "assistant", "content": ""}))
                async for kind, value in events:
                    if kind == "item":
                        yield sse(chunk({"content": value}))
                    elif kind == "done":
                        yield sse(chunk({}, finish_reason(value), {"usage": usage(value)}))
                        yield "data: [DONE]\n\n"
                    else:
                        err = value if isinstance(value, ApiError) else ApiError(
                            500, f"generation failed: {value}", kind="server_error")
                        yield sse(_error_body("/v1/chat/completions", err.status, err.message, err.kind, None,
                                              err.code))
                        yield "data: [DONE]\n\n"

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        def work_once():
            t = time.perf_counter()
            view = CallView(llm, cancelled=cancel.is_set)
            g = queue.run(lambda: view.generate(messages, **kwargs), cancel)
            metrics.stage.labels("generate").observe(time.perf_counter() - t)
            return g

        try:
            g = await run_with_deadline(request, releasing(work_once, queue), seconds, cancel)
        except Cancelled:
            raise ApiError(504, "the request was cancelled before it ran", kind="timeout") from None
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": g.text},
                             "finish_reason": finish_reason(g)}],
                "usage": usage(g)}

    @app.post("/v1/embeddings", responses=OPENAI_ERRORS)
    def embeddings(req: EmbeddingsRequest) -> dict:
        need_engine()
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or len(texts) > 2048:
            raise ApiError(400, "input must hold 1 to 2048 strings", param="input")
        t = time.perf_counter()
        with encoders:
            vectors = embedder.embed(texts)
        metrics.stage.labels("embed").observe(time.perf_counter() - t)
        tokens = int(embedder.count_tokens(texts).sum())
        if req.encoding_format == "base64":
            import base64

            rows = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        else:
            rows = [v.tolist() for v in vectors]
        return {"object": "list", "model": engine.embedder_name,
                "data": [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/rerank", responses=CERTRAG_ERRORS)
    def rerank(req: RerankRequest) -> dict:
        need_engine()
        if reranker is None:
            raise ApiError(404, "this store has no reranker (retrieval.rerank is off)")
        t = time.perf_counter()
        with encoders:
            vectors = embedder.embed([req.query] + list(req.documents))
            dense = vectors[1:] @ vectors[0]
            scores = reranker.score(req.query, list(req.documents), dense)
        metrics.stage.labels("rerank").observe(time.perf_counter() - t)
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: req.top_n or len(scores)]
        results = []
        for i in order:
            row = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents:
                row["document"] = {"text": req.documents[i]}
            results.append(row)
        return {"model": getattr(reranker, "name", "reranker"), "results": results,
                "meta": {"score": "fused logit: cross-encoder + dense_weight * cosine (certrag.rerank)"}}

    def observe_trace(trace: dict) -> None:
        for key, stage in (("embed_ms", "embed"), ("search_ms", "search"), ("rerank_ms", "rerank"),
                           ("select_ms", "select")):
            if trace.get(key) is not None:
                metrics.stage.labels(stage).observe(trace[key] / 1e3)

    @app.post("/v1/retrieve", responses=CERTRAG_ERRORS)
    async def retrieve(req: RetrieveRequest, request: Request) -> dict:
        need_engine()
        cancel = threading.Event()

        def work():
            r = engine.retrieve(req.question, candidates=req.candidates, rerank=req.rerank, where=req.where)
            out = r.to_dict()
            if req.certify:
                out["certification"] = engine.certify(r).to_dict()
            observe_trace(r.trace)
            return out

        seconds = deadline(request, req.timeout)
        encoders.admit()
        try:
            return await run_with_deadline(request, releasing(work, encoders), seconds, cancel)
        except (ValueError, FileNotFoundError) as exc:
            raise ApiError(400, str(exc)) from None

    @app.post("/v1/answer", responses=CERTRAG_ERRORS)
    async def answer(req: AnswerRequest, request: Request):
        need_engine()
        seconds = deadline(request, req.timeout)
        cancel = threading.Event()
        fields = {"strategy": req.strategy, "qtype": req.qtype, "options": req.options, "certify": req.certify,
                  "confidence": req.confidence, "max_new_tokens": req.max_new_tokens}
        check_request_text([req.question, *(req.options or [])], req.max_new_tokens)
        queue.admit()

        def run(emit=None):
            r = engine.retrieve(req.question)
            observe_trace(r.trace)
            if emit is not None:
                emit({"event": "retrieval", "data": r.to_dict()})
            on_text = (lambda d: emit({"event": "token", "data": d})) if emit is not None else None
            t = time.perf_counter()
            a = queue.run(lambda: engine.answer(req.question, retrieval=r, on_text=on_text, cancelled=cancel.is_set,
                                                **fields), cancel)
            metrics.stage.labels("generate").observe(time.perf_counter() - t)
            return a.to_dict()

        if req.stream:
            events = stream_from_thread(run, cancel, seconds, queue.release)

            async def body():
                async for kind, value in events:
                    if kind == "item":
                        yield f"event: {value['event']}\n" + sse(value["data"])
                    elif kind == "done":
                        yield "event: answer\n" + sse(value)
                    else:
                        err = value if isinstance(value, ApiError) else ApiError(
                            400 if isinstance(value, (ValueError, FileNotFoundError)) else 500, str(value))
                        yield "event: error\n" + sse({"status": err.status, "detail": err.message})

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            return await run_with_deadline(request, releasing(run, queue), seconds, cancel)
        except Cancelled:
            raise ApiError(504, "the request was cancelled before it ran", kind="timeout") from None
        except (ValueError, FileNotFoundError) as exc:
            raise ApiError(400, str(exc)) from None

    return app


class _Guard:
    """The outer ASGI layer: the API key, the body limit counted on the bytes actually read (a declared
    Content-Length over the limit is refused before reading; a chunked body as soon as it passes the limit), and
    each request's latency by route and status."""

    def __init__(self, app, *, config: ServeConfig, metrics: Metrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        self.routes: set[str] | None = None
        self.one_at_a_time = asyncio.Lock() if config.serialize else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, metrics, path = self.config, self.metrics, scope["path"]
        if self.routes is None:
            app = scope.get("app")
            self.routes = {r.path for r in getattr(app, "routes", [])}
        started = time.perf_counter()
        status = {"code": 500, "sent": False, "refused": False}

        async def send_counted(message):
            if status["refused"]:
                return  # the guard has answered 413 already: the app's own reply goes nowhere
            if message["type"] == "http.response.start":
                status["code"], status["sent"] = message["status"], True
            await send(message)

        async def reply(code: int, message: str, kind: str, headers: dict | None = None):
            body = json.dumps(_error_body(path, code, message, kind, None, None)).encode()
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
            route = path if path in (self.routes or ()) else "other"
            metrics.latency.labels(route, str(status["code"])).observe(time.perf_counter() - started)


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))
