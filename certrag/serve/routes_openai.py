"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/embeddings.

Chat serves two kinds of model. The RAG models ("certrag" for plain RAG, "certrag:<strategy>" for another; listed by
/v1/models when a store is served, and the default for an empty id) answer from the store: the last user message
is the question that is retrieved for, earlier turns reach the prompt as the conversation so far, and the answer
comes with its evidence -- candidates, selection, cited chunks, certification, p_correct, grounding -- in the
response's `certrag` field (and in the last stream chunk's). A RAG answer is written greedily, then checked
(certrag.grounding) before it is sent, so it streams as one piece; temperature, seed and stop apply to the bare
reader. The bare reader (its own name) is the model without retrieval, streamed token by token. An unknown model id
is 404, as OpenAI and vLLM answer it. stream_options.include_usage adds OpenAI's usage chunk before [DONE].
"""

from __future__ import annotations

import threading
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from certrag.llm.calls import CallView, Cancelled
from certrag.serve.context import ServeState, state_of
from certrag.serve.limits import releasing
from certrag.serve.protocol import OPENAI_ERRORS, ApiError, ChatRequest, EmbeddingsRequest, error_body, sse

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/v1/models", responses=OPENAI_ERRORS)
def models(request: Request) -> dict:
    st, now = state_of(request), int(time.time())
    ids = st.rag_models + [st.reader] + ([st.engine.embedder_name] if st.engine is not None else [])
    return {"object": "list", "data": [{"id": i, "object": "model", "created": now, "owned_by": "certrag"}
                                       for i in ids]}


@router.post("/v1/embeddings", responses=OPENAI_ERRORS)
def embeddings(req: EmbeddingsRequest, request: Request) -> dict:
    st = state_of(request)
    engine = st.need_engine()
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not texts or len(texts) > 2048:
        raise ApiError(400, "input must hold 1 to 2048 strings", param="input")
    t = time.perf_counter()
    with st.encoders:
        vectors = engine.embedder.embed(texts)
    st.metrics.stage.labels("embed").observe(time.perf_counter() - t)
    tokens = int(engine.embedder.count_tokens(texts).sum())
    if req.encoding_format == "base64":
        import base64

        rows = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        rows = [v.tolist() for v in vectors]
    return {"object": "list", "model": engine.embedder_name,
            "data": [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/chat/completions", responses=OPENAI_ERRORS)
async def chat(req: ChatRequest, request: Request):
    st = state_of(request)
    strategy = st.strategy_of(req.model)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop takes at most 4 non-empty strings", param="stop")
    if strategy is None and req.certrag is not None:
        raise ApiError(400, f"certrag options need a RAG model ({', '.join(st.rag_models) or 'a store'}); "
                       f"{st.reader} is the bare reader", param="certrag")
    call = Call(st, req, strategy, stop, request)
    return await (call.rag() if strategy is not None else call.bare())


class Call:
    """One chat completion: its id, deadline, cancel event and options, for the two kinds of model."""

    def __init__(self, st: ServeState, req: ChatRequest, strategy: str | None, stop: list[str],
                 request: Request) -> None:
        self.st, self.req, self.strategy, self.stop, self.request = st, req, strategy, stop, request
        self.max_new = req.max_completion_tokens or req.max_tokens or 128
        self.messages = [m.model_dump() for m in req.messages]
        self.seconds = st.deadline(request, req.timeout)
        self.cancel = threading.Event()
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.model = req.model or (st.rag_models[0] if strategy is not None else st.reader)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def usage(self, prompt: int, completion: int) -> dict:
        self.st.metrics.tokens.labels("prompt").inc(prompt)
        self.st.metrics.tokens.labels("completion").inc(completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, delta: dict | None, finish=None, **extra) -> dict:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def completion(self, text: str, finish: str, usage: dict, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}], "usage": usage, **extra}

    async def respond(self, work, pieces: bool, finish):
        """Runs work(emit) under the generation queue: a completion, or (stream) the events as chunks. pieces:
        the items work emits are content deltas; finish(result) -> (text, finish_reason, usage counts, extra)."""
        st = self.st
        st.queue.admit()
        if not self.req.stream:
            try:
                result = await st.run(self.request, releasing(lambda: work(None), st.queue), self.seconds,
                                      self.cancel)
            except Cancelled:
                raise ApiError(504, "the request was cancelled before it ran", kind="timeout") from None
            except (ValueError, FileNotFoundError) as exc:  # a prompt over the context, a bad option
                raise ApiError(400, str(exc)) from None
            text, reason, (tin, tout), extra = finish(result)
            return self.completion(text, reason, self.usage(tin, tout), **extra)
        events = st.stream(work, self.cancel, self.seconds, st.queue.release)

        async def body():
            yield sse(self.chunk({"role": "assistant", "content": ""}))
            async for kind, value in events:
                if kind == "item" and pieces:
                    yield sse(self.chunk({"content": value}))
                elif kind == "done":
                    text, reason, (tin, tout), extra = finish(value)
                    if not pieces:
                        yield sse(self.chunk({"content": text}))
                    yield sse(self.chunk({}, reason, **extra))
                    usage = self.usage(tin, tout)
                    if self.include_usage:
                        yield sse(self.chunk(None, usage=usage))
                    yield "data: [DONE]\n\n"
                elif kind == "error":
                    err = value if isinstance(value, ApiError) else ApiError(
                        400 if isinstance(value, ValueError) else 500, f"generation failed: {value}",
                        kind="invalid_request_error" if isinstance(value, ValueError) else "server_error")
                    yield sse(error_body("/v1/chat/completions", err.status, err.message, err.kind, None, err.code))
                    yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def bare(self):
        st = self.st
        st.check_prompt(self.messages, self.max_new)
        kwargs = {"max_new_tokens": self.max_new, "temperature": self.req.temperature, "seed": self.req.seed,
                  **({"stop": self.stop} if self.stop else {})}

        def work(emit):
            t = time.perf_counter()
            view = CallView(st.llm, on_text=emit, cancelled=self.cancel.is_set)
            g = st.queue.run(lambda: view.generate(self.messages, **kwargs), self.cancel)
            st.metrics.stage.labels("generate").observe(time.perf_counter() - t)
            return g

        return await self.respond(work, True, lambda g: (g.text, _finish(g.finish_reason),
                                                         (g.input_tokens, g.output_tokens), {}))

    async def rag(self):
        st, engine = self.st, self.st.need_engine()
        if self.messages[-1]["role"] != "user":
            raise ApiError(400, "the last message must be the user's question", param="messages")
        question = self.messages[-1]["content"]
        if not question.strip():
            raise ApiError(400, "the question (the last user message) is empty", param="messages")
        history = tuple((m["role"], m["content"]) for m in self.messages[:-1])
        st.check_request_text([question, *(c for _, c in history)], self.max_new, param="messages")
        opts = self.req.certrag
        fields = {"max_new_tokens": self.max_new, "history": history,
                  "certify": bool(opts and opts.certify), "confidence": bool(opts and opts.confidence),
                  "judge_support": bool(opts and opts.judge_support)}

        def work(emit):
            r = engine.retrieve(question)
            st.observe_trace(r.trace)
            t = time.perf_counter()
            a = st.queue.run(lambda: engine.answer(question, self.strategy, retrieval=r,
                                                   cancelled=self.cancel.is_set, **fields), self.cancel)
            st.metrics.stage.labels("generate").observe(time.perf_counter() - t)
            return a

        def finish(a):
            extra = {"certrag": {**a.to_dict(), "retrieval": a.retrieval.to_dict()}}
            return a.text, _finish(a.finish_reason), (a.input_tokens, a.output_tokens), extra

        return await self.respond(work, False, finish)


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"
