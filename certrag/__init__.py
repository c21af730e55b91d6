"""certrag: low-latency retrieval-augmented generation with evidence of how far each answer can be trusted.

``import certrag`` loads the native core and nothing heavy: no torch, no triton (kernels load lazily from
``certrag.kernels`` when asked for).
"""

from __future__ import annotations

__version__ = "0.1.0"

from certrag.index import HnswIndex, IndexFormatError, SearchResult


def info() -> dict:
    """What this build is: version, compiler, SIMD levels compiled in and active, threading, index format."""
    from certrag import _core

    build = dict(_core.build_info())
    return {"version": __version__, **build}


__all__ = ["HnswIndex", "IndexFormatError", "SearchResult", "info", "__version__"]
