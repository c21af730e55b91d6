"""The stages an Engine runs on, built in one place: the embedder, the reranker (None when the config turns
reranking off) and the LLM (None: the bundled default reader, loaded on first use).

Every entry point builds Stages -- the defaults of a store's config, or models of its own -- and, where it needs
them, wraps them (certrag.runtime: batching, Ray handles) before handing them to the Engine; nothing below an entry
point reaches into a finished Engine for its models.

    from certrag import Engine, EngineConfig
    from certrag.stages import Stages

    stages = Stages.default(EngineConfig())
    engine = Engine.build(["Paris is the capital of France."], "/tmp/kb", stages=stages)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from certrag.config import EngineConfig


@dataclass(frozen=True)
class Stages:
    embedder: object  # certrag.protocols.Embedder
    reranker: object | None = None  # certrag.protocols.Reranker
    llm: object | None = None  # certrag.protocols.LLM; None: certrag.llm.LocalLLM() on first use

    @classmethod
    def default(cls, config: EngineConfig | None = None, *, embedder=None, reranker=None, llm=None) -> "Stages":
        """The stages config names (the bundled embedder and reranker, loaded once per process and backend), with
        any model given here used instead of its default."""
        config = config or EngineConfig()
        return cls(embedder=embedder if embedder is not None else default_embedder(config),
                   reranker=default_reranker(config, reranker), llm=llm)

    def replace(self, **changes) -> "Stages":
        return dataclasses.replace(self, **changes)


def default_embedder(config: EngineConfig):
    """The bundled embedder config names (certrag.embed.Embedder.default); another name needs an Embedder given."""
    from certrag.embed import DEFAULT_MODEL, Embedder

    if config.embedder != DEFAULT_MODEL:
        raise ValueError(f"embedder {config.embedder!r} is not bundled; pass an Embedder instance")
    return Embedder.default(config.encoder_backend)


def default_reranker(config: EngineConfig, reranker=None):
    """reranker, or the bundled one config names; None when config.retrieval.rerank is off."""
    if not config.retrieval.rerank:
        return None
    if reranker is not None:
        return reranker
    from certrag.rerank import CrossEncoderReranker

    return CrossEncoderReranker.default(config.encoder_backend, config.reranker)
