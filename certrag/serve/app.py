"""certrag serve: an OpenAI-compatible /v1/chat/completions backed by a local model, and /v1/answer backed by the
engine. FastAPI gives the OpenAPI schema at /openapi.json; requests above max_body_bytes get 413.

No lock here spans a request: each request's options travel with its call (certrag.answering.AnswerOptions), and
each model serialises its own forward passes (LocalLLM, the embedder and the reranker hold their own locks), so a
retrieval runs while another request generates."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from certrag.strategies import STRATEGY_NAMES


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(default=128, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: int | None = None


class AnswerRequest(BaseModel):
    question: str = Field(min_length=1, max_length=4000)
    strategy: Literal[STRATEGY_NAMES] = "plain"  # certrag.strategies.STRATEGY_NAMES
    qtype: Literal["open", "multiple_choice", "yes_no"] = "open"
    options: list[str] | None = None
    certify: bool = False  # only chunks trusted under the store's conformal calibration (when it holds)
    confidence: bool = False  # P(supported) from lookback ratios (local model with a factuality classifier)


def create_app(llm, engine=None, *, max_body_bytes: int = 1 << 20):
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="certrag", version=__import__("certrag").__version__)
    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return JSONResponse({"detail": f"request body over {max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": getattr(llm, "name", None), "store": str(engine.path) if engine else None}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict:
        g = llm.generate([m.model_dump() for m in req.messages], max_new_tokens=req.max_tokens,
                         temperature=req.temperature, seed=req.seed)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": getattr(llm, "name", req.model),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": g.text},
                             "finish_reason": g.finish_reason}],
                "usage": {"prompt_tokens": g.input_tokens, "completion_tokens": g.output_tokens,
                          "total_tokens": g.input_tokens + g.output_tokens}}

    @app.post("/v1/answer")
    def answer(req: AnswerRequest) -> dict:
        if engine is None:
            raise HTTPException(status_code=404, detail="this server has no store")
        try:
            a = engine.answer(req.question, strategy=req.strategy, qtype=req.qtype, options=req.options,
                              certify=req.certify, confidence=req.confidence)
        except (ValueError, FileNotFoundError) as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        return a.to_dict()

    return app
