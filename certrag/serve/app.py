"""certrag serve: the engine and its models over HTTP, assembled from its parts.

protocol.py holds the wire formats (request schemas, the two error shapes, SSE framing); limits.py the settings,
metrics, the gates that bound what is in flight and the outer ASGI guard; context.py what the routes of one app
share (ServeState on app.state.certrag: the model, the engine, the limits, and the helpers that run a request's
work against its deadline and its client); routes_openai.py OpenAI's /v1/chat/completions (the store's RAG models
and the bare reader), /v1/models and /v1/embeddings; routes_certrag.py the page, /health, /ready, /metrics,
/v1/rerank, /v1/retrieve and /v1/answer.

Concurrency: no lock spans a request. Retrieval runs in the request's worker thread; the embedder and the reranker
sit behind dynamic batchers (certrag.runtime.batching) that gather concurrent requests into shared forward passes.
Generation goes through a bounded queue: a request that finds it full gets 429 with Retry-After, never unbounded
memory; a queued or running generation whose client left, or whose deadline passed (504), stops at its next token
(a prompt being read stops within one prefill chunk). Request bodies are counted as they are read (chunked bodies
too): over the limit is 413. Prompts are checked against the model's context before any work (400).
"""

from __future__ import annotations

from fastapi import Request  # at module level: the handlers' annotations are resolved in this module's namespace

from certrag.serve.context import ServeState
from certrag.serve.limits import Gate, GenerationQueue, Guard, Metrics, ServeConfig
from certrag.serve.protocol import OPENAI_ROUTES, ApiError, error_body

__all__ = ["ServeConfig", "create_app"]


def create_app(llm, engine=None, config: ServeConfig | None = None, *, max_body_bytes: int | None = None,
               batch_encoders: bool = True):
    """The ASGI app. llm: a LocalLLM or an OpenAI-compatible client (certrag.llm.OpenAICompatibleLLM); engine: an
    open Engine (read-only is enough) for the RAG models of /v1/chat/completions, /v1/embeddings, /v1/rerank,
    /v1/retrieve and /v1/answer. The app serves the engine's store on the engine's stages, with its embedder and
    reranker behind dynamic batchers (certrag.runtime.batching.batched) and llm as its model; batch_encoders=False
    leaves the stages as they are: on Ray Serve they batch in their own deployment (@serve.batch), and one batcher
    thread here would keep all but one of its replicas idle."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from certrag.runtime.batching import batched
    from certrag.serve import routes_certrag, routes_openai

    config = config or ServeConfig()
    if max_body_bytes is not None:
        config = ServeConfig(**{**config.__dict__, "max_body_bytes": max_body_bytes})
    metrics = Metrics()
    if engine is not None:
        stages = engine.stages.replace(llm=llm) if llm is not None else engine.stages
        if batch_encoders:
            # the encoders load on first use: here, so that /ready means ready and no request pays for it
            stages.embedder.embed(["certrag"])
            if stages.reranker is not None:
                stages.reranker.cross_scores(["certrag"], ["certrag"])
            stages = batched(stages, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                             on_batch=metrics.on_batch, rerank_instances=config.rerank_instances)
        engine = engine.with_stages(stages)

    app = FastAPI(title="certrag", version=__import__("certrag").__version__)
    app.state.certrag = ServeState(
        llm=llm, engine=engine, config=config, metrics=metrics, queue=GenerationQueue(config.queue_depth, metrics),
        encoders=Gate(config.encoder_depth, "the encoder queue", metrics.encoder_requests, metrics.rejected),
        ready=llm is not None)
    app.state.metrics = metrics
    app.state.config = config
    routers = (routes_certrag.router, routes_openai.router)
    for router in routers:
        app.include_router(router)
    app.add_middleware(Guard, config=config, metrics=metrics, routes={r.path for rt in routers for r in rt.routes})

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(request.url.path, exc.status, exc.message, exc.kind, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own (a body that is not JSON: 400; an unknown route: 404), in the route's error shape
        return JSONResponse(error_body(request.url.path, exc.status_code, str(exc.detail), "invalid_request_error",
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
            return JSONResponse(error_body(request.url.path, 400, message, "invalid_request_error", where, None),
                                status_code=400)
        return JSONResponse({"detail": [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg")),
                                         "type": str(e.get("type"))} for e in errors]}, status_code=422)

    return app
