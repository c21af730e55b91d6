"""certrag serve's wire formats: the request schemas of every route, the two error shapes (OpenAI's
{"error": {...}} on the OpenAI routes, {"detail": ...} on certrag's own) and the server-sent event framing."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from certrag.strategies import STRATEGY_NAMES

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/models", "/v1/embeddings")


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


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices, as OpenAI sends it


class RagOptions(Strict):
    """certrag's extension of a chat request to a RAG model (the openai client's extra_body={"certrag": {...}})."""

    certify: bool = False  # only chunks trusted under the store's conformal calibration (when it holds)
    confidence: bool = False  # fill p_correct: P(the answer contains a correct answer); a local model's classifier
    judge_support: bool = False  # support decided by a reader judging the best chunk (certrag.certify.presence)


class ChatRequest(Strict):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only 1 is supported")
    user: str | None = None
    timeout: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False,
                                  description="seconds; at most the server's")
    certrag: RagOptions | None = None


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
    confidence: bool = False  # fill p_correct: P(the answer contains a correct answer); a local model's classifier
    judge_support: bool = False  # support decided by a reader judging the best chunk (certrag.certify.presence)
    max_new_tokens: int | None = Field(default=None, ge=1, le=4096)
    stream: bool = False
    timeout: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False)


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


def error_body(path: str, status: int, message: str, kind: str, param: str | None, code: str | None) -> dict:
    if path.startswith(OPENAI_ROUTES):
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"detail": message}


def sse(obj, event: str | None = None) -> str:
    """One server-sent event: data as JSON, with an event name when given."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(obj)}\n\n"
