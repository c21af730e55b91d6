"""The engine's configuration: frozen keyword-only dataclasses, saved and loaded as JSON (or YAML with PyYAML).

Every field is read by the engine. Names are checked against their family's one registry: chunkers against
certrag.segment.CHUNKERS, selectors against certrag.select.SELECTORS."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from certrag.rerank import DEFAULT_RERANKER, check_reranker
from certrag.segment import CHUNKERS, SegmenterConfig
from certrag.select import SELECTORS, Selector

log = logging.getLogger(__name__)

# Fields that earlier versions wrote into store manifests and that no longer exist: dropped on load (with a
# warning), so that older stores still open.
RETIRED_FIELDS = {"retrieval": ("dense_weight",)}


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """The HNSW index over chunk embeddings (see certrag.HnswIndex)."""

    metric: str = "cosine"
    M: int = 16
    ef_construction: int = 200
    ef_search: int = 64  # per-query breadth; raised to the candidate count when smaller
    shards: int = 1  # HNSW shards, by a stable hash of the document id (certrag.shards); searched by scatter-gather

    def __post_init__(self) -> None:
        from certrag.shards import check_shards

        if self.metric not in ("ip", "l2", "cosine"):
            raise ValueError(f"index.metric must be ip, l2 or cosine; got {self.metric!r}")
        check_shards(self.shards, "index.shards")
        for name in ("M", "ef_construction", "ef_search"):
            if getattr(self, name) < (2 if name == "M" else 1):
                raise ValueError(f"index.{name} is too small: {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """candidates: how many chunks the index returns per question (N); rerank: score them with the cross-encoder
    (whose fusion with the dense score, ce + w * cos, is part of the trained reranker: its card holds w);
    rerank_batch: (question, passage) pairs per cross-encoder forward pass (length-sorted, each batch padded to its
    own longest pair); adaptive_rerank: skip the cross-encoder for a question whose dense ranking is already
    decisive (the reranker card's skip_rule, fitted on the train split; the trace says whether a question was
    reranked, and a skipped question keeps the dense order and is cut on w * cos, the fused score's dense term)."""

    candidates: int = 20
    rerank: bool = True
    rerank_batch: int = 32
    adaptive_rerank: bool = False

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError(f"retrieval.candidates must be at least 1; got {self.candidates}")
        if self.rerank_batch < 1:
            raise ValueError(f"retrieval.rerank_batch must be at least 1; got {self.rerank_batch}")


@dataclass(frozen=True, kw_only=True)
class SelectionConfig:
    """method: gradient (SAGE), topk, autocut (Weaviate) or topp; the other fields are each method's parameters.

    The defaults were chosen on the NQ-open *train* split (benchmarks/bench_retrieval.py --choose-with) for a stated
    target: the fewest context tokens whose gold-passage recall reaches fixed top-5's, among every selector, on train
    questions no reranker involved had learned from: the 534 train questions held out by a probe reranker made by
    the 6-layer reranker's recipe on the other half of train (`certrag train-reranker --val-fraction 0.5`; the
    shipped 3-layer one is distilled from such a reranker), ranked by it.
    There top-p at p = 0.92 wins (recall 0.974 at 330 tokens, top-5's 0.974 at 535); on test with the shipped
    reranker: 0.981 at 322 tokens against top-5's 0.974 at 543 (59%). The gradient rule (SAGE's method, and what
    the feedback loop re-runs with min_k moved) has g = 10, its cheapest setting reaching top-5's recall there (test
    0.979 at 73% of top-5's tokens; before: g = 20, chosen with the 6-layer reranker on all of train).
    Before: p = 0.97, chosen on the shipped reranker's own 164 unseen train questions (test 0.986 at 83%), and before
    that gradient g = 1.5, which kept one chunk on most questions (test recall 0.862)."""

    method: str = "topp"
    min_k: int = 1
    g: float = 10.0
    max_k: int = 10
    k: int = 5
    jumps: int = 1
    p: float = 0.92
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in SELECTORS:
            raise ValueError(f"selection.method must be one of {sorted(SELECTORS)}; got {self.method!r}")
        for method in SELECTORS:  # every field is checked, not only the chosen method's: each is documented
            try:
                self._make(method)
            except ValueError as exc:
                raise ValueError(f"selection: {exc}") from None

    def make(self) -> Selector:
        return self._make(self.method)

    def _make(self, method: str) -> Selector:
        from certrag.select import AutocutSelector, GradientSelector, TopKSelector, TopPSelector

        if method == "gradient":
            return GradientSelector(min_k=self.min_k, g=self.g, max_k=self.max_k)
        if method == "topk":
            return TopKSelector(k=self.k)
        if method == "autocut":
            return AutocutSelector(jumps=self.jumps, max_k=self.max_k)
        return TopPSelector(p=self.p, temperature=self.temperature, max_k=self.max_k)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    chunker: str = "sage"  # a name in certrag.segment.CHUNKERS: sage | fixed | fixed_sentence | semantic_percentile
    segmenter: SegmenterConfig = field(default_factory=SegmenterConfig)
    embedder: str = "sentence-transformers/all-MiniLM-L6-v2"
    # how the bundled encoders run: auto | float32 | bfloat16 | int8 (certrag.backends; falls back where the CPU
    # cannot run the choice natively)
    encoder_backend: str = "auto"
    # which shipped cross-encoder reranks (certrag.rerank.PACKAGE_RERANKERS): the default, or the one distilled to
    # 3 layers (half the cost per pair; its quality against the default's is in benchmarks/RESULTS.md)
    reranker: str = DEFAULT_RERANKER
    index: IndexConfig = field(default_factory=IndexConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)

    def __post_init__(self) -> None:
        if self.chunker not in CHUNKERS:
            raise ValueError(f"chunker must be one of {', '.join(CHUNKERS)}; got {self.chunker!r}")
        from certrag.backends import check_backend

        check_backend(self.encoder_backend, "encoder_backend")
        check_reranker(self.reranker, "reranker")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        if not isinstance(data, dict):
            raise ValueError("an engine config must be a mapping")
        nested = {"segmenter": SegmenterConfig, "index": IndexConfig, "retrieval": RetrievalConfig,
                  "selection": SelectionConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        kwargs = {}
        for key, value in data.items():
            if key in nested:
                sub = nested[key]
                sub_known = {f.name for f in dataclasses.fields(sub)}
                retired = set(RETIRED_FIELDS.get(key, ())) & set(value) if isinstance(value, dict) else set()
                if retired:
                    log.warning("ignoring retired config fields %s in %s", sorted(retired), key)
                    value = {k: v for k, v in value.items() if k not in retired}
                if not isinstance(value, dict) or set(value) - sub_known:
                    raise ValueError(f"unknown keys in {key}: {sorted(set(value) - sub_known)}"
                                     if isinstance(value, dict) else f"{key} must be a mapping")
                kwargs[key] = sub(**value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        data = self.to_dict()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        from certrag.atomic import write_file_atomic

        write_file_atomic(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EngineConfig":
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return cls.from_dict(yaml.safe_load(text))
        return cls.from_dict(json.loads(text))
