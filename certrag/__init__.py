"""certrag: low-latency retrieval-augmented generation with evidence of how far each answer can be trusted.

``import certrag`` loads the native core and nothing heavy: no torch, no triton (kernels load lazily from
``certrag.kernels`` when asked for).
"""

from __future__ import annotations

__version__ = "0.1.0"

from certrag.index import HnswIndex, IndexFormatError, SearchResult


def __getattr__(name: str):
    # The segmentation API pulls in the embedder (torch, transformers) only when first used.
    if name in ("Segmenter", "SegmenterConfig", "SegmenterHead", "Chunk", "Embedder"):
        if name == "Embedder":
            from certrag.embed import Embedder

            return Embedder
        import certrag.segment as segment

        return getattr(segment, name)
    raise AttributeError(f"module 'certrag' has no attribute {name!r}")


def info() -> dict:
    """What this build is: version, compiler, SIMD levels compiled in and active, threading, index format."""
    from certrag import _core

    build = dict(_core.build_info())
    return {"version": __version__, **build}


__all__ = ["Chunk", "Embedder", "HnswIndex", "IndexFormatError", "SearchResult", "Segmenter", "SegmenterConfig",
           "SegmenterHead", "info", "__version__"]
