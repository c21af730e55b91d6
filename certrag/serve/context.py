"""What every route of one app shares, kept on app.state.certrag: the model, the engine, the limits, and the helpers
that run a request's work in a worker thread against its deadline and its client (routes read it with
state_of(request)). Nothing here holds per-request state: a request's deadline, cancel event and options travel
in the call.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from certrag.protocols import TokenLLM
from certrag.runtime.streams import ERROR, TIMEOUT, ThreadStream
from certrag.serve.limits import Gate, GenerationQueue, Metrics, ServeConfig
from certrag.serve.protocol import ApiError
from certrag.strategies import STRATEGY_NAMES

RAG_MODEL = "certrag"  # the RAG model's id: "certrag" answers with plain RAG, "certrag:<strategy>" with another


@dataclass
class ServeState:
    llm: object
    engine: object  # a read-only certrag Engine, or None (no store: the bare model only)
    config: ServeConfig
    metrics: Metrics
    queue: GenerationQueue
    encoders: Gate
    ready: bool

    # ---- models ----------------------------------------------------------------------------------------------

    @property
    def reader(self) -> str:
        return getattr(self.llm, "name", "llm")

    @property
    def rag_models(self) -> list[str]:
        """The RAG model ids (none without a store)."""
        if self.engine is None:
            return []
        return [RAG_MODEL] + [f"{RAG_MODEL}:{s}" for s in STRATEGY_NAMES if s != "plain"]

    def strategy_of(self, model: str) -> str | None:
        """The strategy a chat request's model id asks for (None: the bare reader, no retrieval); 404 for an id
        this server does not serve. An empty id is the RAG model when there is a store, else the reader."""
        if model == "" and self.engine is not None:
            return "plain"
        if model in ("", self.reader):
            return None
        if model in self.rag_models:
            return model.partition(":")[2] or "plain"
        raise ApiError(404, f"the model {model!r} does not exist on this server; GET /v1/models lists "
                       f"{', '.join(self.rag_models + [self.reader])}", param="model", code="model_not_found")

    def need_engine(self):
        if self.engine is None:
            raise ApiError(404, "this server has no store: start it with `certrag serve STORE`")
        return self.engine

    # ---- admission -------------------------------------------------------------------------------------------

    def deadline(self, request: Request, asked: float | None) -> float:
        header = request.headers.get("x-request-timeout")
        values = [self.config.timeout_s] + ([asked] if asked is not None else [])
        if header is not None:
            try:
                h = float(header)
            except ValueError:
                raise ApiError(400, "X-Request-Timeout must be a number of seconds") from None
            if not (math.isfinite(h) and h > 0):
                raise ApiError(400, "X-Request-Timeout must be a positive number of seconds")
            values.append(h)
        return min(values)

    def check_prompt(self, messages: list[dict], max_new: int) -> int:
        """The prompt's tokens, after checking that they and max_new fit the model's context (400 if not)."""
        if not isinstance(self.llm, TokenLLM):
            return 0
        n, limit = len(self.llm.prompt_ids(messages)), self.llm.context_length
        if limit and n + max_new > limit:
            self.metrics.rejected.labels("context").inc()
            raise ApiError(400, f"the prompt ({n} tokens) plus max_tokens ({max_new}) exceeds the model's context "
                           f"of {limit} tokens", param="messages", code="context_length_exceeded")
        return n

    def check_request_text(self, texts: list[str], max_new: int | None, param: str = "question") -> None:
        """Before queueing a request whose prompt the engine builds (retrieved passages around the question and its
        options): the question and options alone must leave room in the model's context. The full prompt is
        checked again by the model before any work (PromptTooLong: 400 too)."""
        if not isinstance(self.llm, TokenLLM):
            return
        n, limit, max_new = sum(self.llm.count_tokens(t) for t in texts), self.llm.context_length, max_new or 0
        if limit and n + max_new > limit:
            self.metrics.rejected.labels("context").inc()
            raise ApiError(400, f"the question and its options ({n} tokens) plus max_new_tokens ({max_new}) exceed "
                           f"the model's context of {limit} tokens", param=param, code="context_length_exceeded")

    def observe_trace(self, trace: dict) -> None:
        for key, stage in (("embed_ms", "embed"), ("search_ms", "search"), ("rerank_ms", "rerank"),
                           ("select_ms", "select")):
            if trace.get(key) is not None:
                self.metrics.stage.labels(stage).observe(trace[key] / 1e3)

    # ---- running -----------------------------------------------------------------------------------------------

    def timed_out(self, seconds: float, cancel: threading.Event) -> ApiError:
        cancel.set()
        self.metrics.rejected.labels("deadline").inc()
        return ApiError(504, f"the request ran past its deadline of {seconds:g} s", kind="timeout",
                        code="deadline_exceeded")

    async def run(self, request: Request, fn, seconds: float, cancel: threading.Event):
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
                    raise self.timed_out(seconds, cancel)
                if await request.is_disconnected():
                    cancel.set()
                    self.metrics.rejected.labels("disconnected").inc()
                    raise ApiError(499, "the client closed the request", kind="client_closed")
        except BaseException:
            cancel.set()
            raise

    async def stream(self, fn, cancel: threading.Event, seconds: float, on_end):
        """The events of fn(emit) run in a worker thread (certrag.runtime.streams): ("item", x)..., then ("done",
        result) or ("error", exc); past the deadline ("error", a 504 ApiError). The work stops when the client
        leaves (the response is cancelled) or the deadline passes."""
        async for kind, value in ThreadStream(fn, cancel=cancel, on_end=on_end).events(seconds):
            if kind == TIMEOUT:
                yield ERROR, self.timed_out(seconds, cancel)
                return
            yield kind, value


def state_of(request: Request) -> ServeState:
    return request.app.state.certrag
