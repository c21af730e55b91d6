"""What each stage must offer, declared once: the Embedder, the Reranker and the LLM, with the LLM's optional
capabilities as protocols of their own (streaming, lookback recording, the token-level surface Self-RAG reads).

Every implementation -- the local models (certrag.embed.Embedder, certrag.rerank.CrossEncoderReranker,
certrag.llm.LocalLLM), the server's batching views (certrag.runtime.batching), the Ray handles
(certrag.scale.serving.Remote*) and the OpenAI-compatible client -- passes the same conformance test
(tests/test_protocols.py). Code that needs a capability asks with isinstance(llm, TokenLLM) (or the flag the
protocol names), never by probing for attributes.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Embedder(Protocol):
    """Texts to unit vectors. name identifies the model (a store records it); dim is the vector size."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...  # float32 (n, dim), unit rows

    def count_tokens(self, texts: list[str]) -> np.ndarray: ...  # int64 (n,), the model's own tokens


@runtime_checkable
class Reranker(Protocol):
    """A cross-encoder fused with the dense score: score(q, p) = cross_scores(q, p) + dense_weight * cos(q, p).
    identity is what a calibration must match; skip_rule (or None) is the adaptive rule shipped with it."""

    name: str
    dense_weight: float
    identity: dict
    skip_rule: dict | None

    def cross_scores(self, questions: list[str], passages: list[str], *,
                     batch_size: int | None = None) -> np.ndarray: ...

    def score(self, question: str, passages: list[str], dense_scores: np.ndarray, *,
              batch_size: int | None = None) -> np.ndarray: ...


@runtime_checkable
class LLM(Protocol):
    """Chat messages in, a certrag.llm.local.Generation out."""

    name: str

    def generate(self, messages: list[dict], *, max_new_tokens: int = ..., temperature: float = ...,
                 seed: int | None = ...): ...


@runtime_checkable
class StreamingLLM(LLM, Protocol):
    """An LLM whose generate takes on_text(piece) and cancelled() and honours them per token (streams_text)."""

    streams_text: bool


@runtime_checkable
class LookbackLLM(LLM, Protocol):
    """An LLM that records lookback ratios while it writes (generate(..., record_lookback=True)): the factual
    confidence reads them."""

    records_lookback: bool


@runtime_checkable
class TokenLLM(LLM, Protocol):
    """The token-level surface Self-RAG's reflection scores read: the chat prompt's ids, the probabilities of given
    next tokens after given prompts, and how many tokens of an id sequence spell a text prefix."""

    context_length: int
    tokenizer: object  # a transformers tokenizer: get_vocab(), __call__(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]: ...

    def next_token_probs(self, prompts: list[list[int]], token_ids: list[int], *,
                         batch_size: int = ...) -> np.ndarray: ...

    def prefix_tokens(self, token_ids: Sequence[int], text: str) -> int: ...

    def count_tokens(self, text: str) -> int: ...


def streams(llm: object) -> bool:
    """Whether llm streams per token (StreamingLLM with streams_text true)."""
    return isinstance(llm, StreamingLLM) and bool(llm.streams_text)


def records_lookback(llm: object) -> bool:
    """Whether llm records lookback ratios (LookbackLLM with records_lookback true)."""
    return isinstance(llm, LookbackLLM) and bool(llm.records_lookback)


OnText = Callable[[str], None]
