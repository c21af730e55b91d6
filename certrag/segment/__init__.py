"""Semantic segmentation (SAGE) and the chunkers it is measured against."""

from __future__ import annotations

from certrag.segment.chunkers import (Chunk, Chunker, FixedSizeChunker, PercentileSemanticChunker, Segmenter,
                                      SegmenterConfig, SentenceFixedChunker)
from certrag.segment.head import SegmenterHead
from certrag.segment.sentences import Sentence, split_sentences


def make_chunker(name: str, config: SegmenterConfig | None = None, *, min_tokens: int = 24, max_tokens: int = 256,
                 threshold: float = 0.5, embedder=None) -> Chunker:
    """A chunker by name: sage, fixed, fixed_sentence or semantic_percentile. Sizes come from config when given
    (the whole SegmenterConfig reaches SAGE), else from the keyword arguments."""
    if config is None:
        config = SegmenterConfig(min_tokens=min_tokens, max_tokens=max_tokens, threshold=threshold)
    if name == "sage":
        from certrag.embed import Embedder

        return Segmenter(embedder=embedder or Embedder.default(), config=config)
    if name == "fixed":
        return FixedSizeChunker(config.max_tokens, embedder)
    if name == "fixed_sentence":
        return SentenceFixedChunker(config.max_tokens, embedder)
    if name == "semantic_percentile":
        return PercentileSemanticChunker(embedder=embedder)
    raise ValueError(f"unknown chunker {name!r}; choose from sage, fixed, fixed_sentence, semantic_percentile")


__all__ = ["Chunk", "Chunker", "FixedSizeChunker", "PercentileSemanticChunker", "Segmenter", "SegmenterConfig",
           "SegmenterHead", "Sentence", "SentenceFixedChunker", "make_chunker", "split_sentences"]
