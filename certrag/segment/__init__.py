"""Semantic segmentation (SAGE) and the chunkers it is measured against."""

from __future__ import annotations

from certrag.segment.chunkers import (Chunk, Chunker, FixedSizeChunker, PercentileSemanticChunker, Segmenter,
                                      SegmenterConfig, SentenceFixedChunker)
from certrag.segment.head import SegmenterHead
from certrag.segment.sentences import Sentence, split_sentences


def _sage(config: SegmenterConfig, embedder) -> Chunker:
    from certrag.embed import Embedder

    return Segmenter(embedder=embedder or Embedder.default(), config=config)


CHUNKERS = {
    "sage": _sage,
    "fixed": lambda config, embedder: FixedSizeChunker(config.max_tokens, embedder),
    "fixed_sentence": lambda config, embedder: SentenceFixedChunker(config.max_tokens, embedder),
    "semantic_percentile": lambda config, embedder: PercentileSemanticChunker(embedder=embedder),
}
"""The one registry of chunker names: name -> factory(SegmenterConfig, embedder or None)."""


def make_chunker(name: str, config: SegmenterConfig | None = None, *, min_tokens: int = 24, max_tokens: int = 256,
                 threshold: float = 0.5, embedder=None) -> Chunker:
    """A chunker by name (one of CHUNKERS). Sizes come from config when given (the whole SegmenterConfig reaches
    SAGE), else from the keyword arguments."""
    if name not in CHUNKERS:
        raise ValueError(f"unknown chunker {name!r}; choose from {', '.join(CHUNKERS)}")
    if config is None:
        config = SegmenterConfig(min_tokens=min_tokens, max_tokens=max_tokens, threshold=threshold)
    return CHUNKERS[name](config, embedder)


__all__ = ["CHUNKERS", "Chunk", "Chunker", "FixedSizeChunker", "PercentileSemanticChunker", "Segmenter",
           "SegmenterConfig", "SegmenterHead", "Sentence", "SentenceFixedChunker", "make_chunker", "split_sentences"]
