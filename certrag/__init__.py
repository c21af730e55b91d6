"""certrag: low-latency retrieval-augmented generation with evidence of how far each answer can be trusted.

``import certrag`` loads the native core and nothing heavy: no torch, no triton. The public names below load their
modules when first used (the models inside them load later still, when first asked for); kernels load lazily from
``certrag.kernels`` on a GPU path.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

from certrag.index import HnswIndex, IndexFormatError, IndexIOError, SearchResult

# public name -> the module that defines it
_LAZY = {
    "Engine": "certrag.engine", "BuildReport": "certrag.engine",
    "EngineConfig": "certrag.config", "IndexConfig": "certrag.config", "RetrievalConfig": "certrag.config",
    "SelectionConfig": "certrag.config",
    "Retrieval": "certrag.retrieval",
    "Answer": "certrag.answering", "AnswerOptions": "certrag.answering",
    "Segmenter": "certrag.segment", "SegmenterConfig": "certrag.segment", "SegmenterHead": "certrag.segment",
    "Chunk": "certrag.segment",
    "Embedder": "certrag.embed", "CrossEncoderReranker": "certrag.rerank",
    "LocalLLM": "certrag.llm", "OpenAIChatClient": "certrag.llm.openai_client", "PriceTable": "certrag.cost",
    "Plain": "certrag.strategies", "ChainOfNote": "certrag.strategies", "Feedback": "certrag.strategies",
    "SelfRag": "certrag.strategies",
    "StoreError": "certrag.store", "CalibrationError": "certrag.certify.conformal",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certrag' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def info() -> dict:
    """What this build is: version, compiler, SIMD levels compiled in and active, threading, index format, and how
    the encoders run here (the backend "auto" resolves to on this CPU, and why)."""
    from certrag import _core
    from certrag.backends import cpu_features, resolve

    build = dict(_core.build_info())
    return {"version": __version__, **build, "encoder_backend": resolve("auto").as_dict(),
            "encoder_cpu_features": sorted(cpu_features())}


__all__ = sorted([*_LAZY, "HnswIndex", "IndexFormatError", "IndexIOError", "SearchResult", "info", "__version__"])
