"""certrag's own routes: the page (/), /health, /ready, /metrics (Prometheus text), /v1/rerank (the query + documents
format Cohere, Jina and text-embeddings-inference share), /v1/retrieve and /v1/answer (streamed as events: the
retrieval, each token, then the answer)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from certrag.llm.calls import Cancelled
from certrag.serve.context import state_of
from certrag.serve.limits import releasing
from certrag.serve.protocol import CERTRAG_ERRORS, AnswerRequest, ApiError, RerankRequest, RetrieveRequest, sse

router = APIRouter()
STATIC = Path(__file__).resolve().parent / "static"


@router.get("/", include_in_schema=False)
def page():
    """A page to ask questions and watch the answer stream in with its evidence (no build step, no CDN)."""
    return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8")


@router.get("/health")
def health() -> dict:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"model": dict}})
def ready(request: Request):
    st = state_of(request)
    body = {"ready": st.ready, "model": st.reader, "store": str(st.engine.path) if st.engine else None,
            "queue": st.queue.count, "queue_depth": st.config.queue_depth, "encoder_requests": st.encoders.count,
            "encoder_depth": st.config.encoder_depth,
            "confidence": _offers_confidence(st.llm), "p_correct": _p_correct_about(st.llm),
            "judge_support": _offers_judge_support(st.engine)}
    decode = getattr(st.llm, "engine", None)  # a local model's decode engine (a remote one reports nothing here)
    if decode is not None:
        running, waiting = decode.load
        body.update(decoding=running, decode_waiting=waiting, decode_batch_max=decode.max_rows)
    return JSONResponse(body, status_code=200 if st.ready else 503)


def _offers_confidence(llm) -> bool:
    """Whether answers can carry p_correct: a local model (lookback, token probabilities) with a classifier shipped."""
    from certrag.certify.factuality import has_classifier
    from certrag.protocols import records_lookback

    return records_lookback(llm) and has_classifier(getattr(llm, "name", ""))


def _offers_judge_support(engine) -> bool:
    """Whether an answer may ask for judge_support: the store's reranker ships an answer-presence rule and the
    rule's reader is installed."""
    from certrag.llm.models import BUNDLED_MODELS

    rule = engine.presence_rule if engine is not None else None
    return rule is not None and rule.judge in BUNDLED_MODELS and BUNDLED_MODELS[rule.judge].installed


def _p_correct_about(llm) -> dict | None:
    """What an answer's p_correct means for this model, from its classifier's card; None when none is offered."""
    if not _offers_confidence(llm):
        return None
    from certrag.certify.factuality import LABEL, FactualityClassifier

    clf = FactualityClassifier.for_model(llm.name)
    card = clf.card
    about = card.get("summary") or clf.describe()
    return {"means": LABEL, "score": clf.score_name, "about": about,
            "heldout_auroc": card.get("heldout_auroc"), "logprob_heldout_auroc": card.get("logprob_heldout_auroc")}


@router.get("/metrics", responses={**CERTRAG_ERRORS, 200: {"content": {"text/plain": {}},
                                                           "description": "Prometheus text format"}})
def metrics(request: Request):
    return Response(state_of(request).metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/v1/rerank", responses=CERTRAG_ERRORS)
def rerank(req: RerankRequest, request: Request) -> dict:
    st = state_of(request)
    engine = st.need_engine()
    if engine.reranker is None:
        raise ApiError(404, "this store has no reranker (retrieval.rerank is off)")
    t = time.perf_counter()
    with st.encoders:
        vectors = engine.embedder.embed([req.query] + list(req.documents))
        scores = engine.reranker.score(req.query, list(req.documents), vectors[1:] @ vectors[0])
    st.metrics.stage.labels("rerank").observe(time.perf_counter() - t)
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: req.top_n or len(scores)]
    results = []
    for i in order:
        row = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            row["document"] = {"text": req.documents[i]}
        results.append(row)
    return {"model": engine.reranker.name, "results": results,
            "meta": {"score": "fused logit: cross-encoder + dense_weight * cosine (certrag.rerank)"}}


@router.post("/v1/retrieve", responses=CERTRAG_ERRORS)
async def retrieve(req: RetrieveRequest, request: Request) -> dict:
    st = state_of(request)
    engine = st.need_engine()
    cancel = threading.Event()

    def work():
        r = engine.retrieve(req.question, candidates=req.candidates, rerank=req.rerank, where=req.where)
        out = r.to_dict()
        if req.certify:
            out["certification"] = engine.certify(r).to_dict()
        st.observe_trace(r.trace)
        return out

    seconds = st.deadline(request, req.timeout)
    st.encoders.admit()
    try:
        return await st.run(request, releasing(work, st.encoders), seconds, cancel)
    except (ValueError, FileNotFoundError) as exc:
        raise ApiError(400, str(exc)) from None


@router.post("/v1/answer", responses=CERTRAG_ERRORS)
async def answer(req: AnswerRequest, request: Request):
    st = state_of(request)
    engine = st.need_engine()
    seconds = st.deadline(request, req.timeout)
    cancel = threading.Event()
    fields = {"qtype": req.qtype, "options": req.options, "certify": req.certify, "confidence": req.confidence,
              "judge_support": req.judge_support, "max_new_tokens": req.max_new_tokens}
    st.check_request_text([req.question, *(req.options or [])], req.max_new_tokens)
    st.queue.admit()

    def run(emit=None):
        r = engine.retrieve(req.question)
        st.observe_trace(r.trace)
        if emit is not None:
            emit({"event": "retrieval", "data": r.to_dict()})
        on_text = (lambda d: emit({"event": "token", "data": d})) if emit is not None else None
        t = time.perf_counter()
        a = st.queue.run(lambda: engine.answer(req.question, req.strategy, retrieval=r, on_text=on_text,
                                               cancelled=cancel.is_set, **fields), cancel)
        st.metrics.stage.labels("generate").observe(time.perf_counter() - t)
        return a.to_dict()

    if req.stream:
        events = st.stream(run, cancel, seconds, st.queue.release)

        async def body():
            async for kind, value in events:
                if kind == "item":
                    yield sse(value["data"], value["event"])
                elif kind == "done":
                    yield sse(value, "answer")
                else:
                    err = value if isinstance(value, ApiError) else ApiError(
                        400 if isinstance(value, (ValueError, FileNotFoundError)) else 500, str(value))
                    yield sse({"status": err.status, "detail": err.message}, "error")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    try:
        return await st.run(request, releasing(run, st.queue), seconds, cancel)
    except Cancelled:
        raise ApiError(504, "the request was cancelled before it ran", kind="timeout") from None
    except (ValueError, FileNotFoundError) as exc:
        raise ApiError(400, str(exc)) from None
