"""Retrieval, one stage: embed the questions, search the HNSW index for N candidates, rerank them with the
cross-encoder, and cut the context with the selector -- over one published view of the store.

It knows nothing of how answers are written: it returns a Retrieval (candidates best first, scores, the cut and a
per-stage latency trace) and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from certrag.config import EngineConfig
from certrag.index import HnswIndex
from certrag.select import Selector, cut


@dataclass(frozen=True)
class Retrieval:
    """Candidates for one question, best first (reranked order when a reranker ran), and how many were selected.

    chunk_ids: int64 (n,); dense_scores: float32 (n,) cosine similarities (embeddings are unit vectors, so every
    index metric maps to the cosine); rerank_scores: float32
    (n,) fused reranker logits, NaN when no reranker ran; selected: the first `selected` candidates form the
    context; trace: per-stage latency in milliseconds and what ran.
    """

    question: str
    chunk_ids: np.ndarray
    doc_ids: tuple[str, ...]
    texts: tuple[str, ...]
    dense_scores: np.ndarray
    rerank_scores: np.ndarray
    selected: int
    trace: dict = field(default_factory=dict)

    @property
    def selected_chunk_ids(self) -> np.ndarray:
        return self.chunk_ids[: self.selected]

    @property
    def selected_texts(self) -> tuple[str, ...]:
        return self.texts[: self.selected]

    def to_dict(self) -> dict:
        return {"question": self.question, "selected": self.selected, "trace": self.trace,
                "candidates": [{"chunk_id": int(c), "doc_id": d, "dense_score": float(s),
                                "rerank_score": None if np.isnan(r) else float(r), "selected": i < self.selected,
                                "text": t}
                               for i, (c, d, t, s, r) in enumerate(zip(self.chunk_ids, self.doc_ids, self.texts,
                                                                        self.dense_scores, self.rerank_scores))]}


@dataclass(frozen=True)
class StoreView:
    """What a reader searches: the index and the chunks of one published store version. chunks[position[id]] is
    the chunk with that id. Never changed after it is published; a writer publishes a new view."""

    index: HnswIndex
    chunks: Sequence[dict]
    position: Mapping[int, int]
    documents: Mapping[str, dict] = field(default_factory=dict)  # doc id -> {"metadata": ..., ...}

    def __len__(self) -> int:
        return len(self.chunks)


def check_where(where) -> dict | None:
    """A metadata filter: {key: value} (equal) or {key: [values]} (any of them); all keys must match."""
    if where is None:
        return None
    if not isinstance(where, Mapping) or not where:
        raise ValueError("where must be a non-empty mapping of metadata keys to a value or a list of values")
    out = {}
    for k, v in where.items():
        if not isinstance(k, str):
            raise ValueError(f"where: keys must be strings; got {k!r}")
        values = tuple(v) if isinstance(v, (list, tuple, set, frozenset)) else (v,)
        for x in values:  # metadata values compare by equality: a dict or list here would silently match nothing
            if x is not None and not isinstance(x, (str, int, float, bool)):
                raise ValueError(f"where[{k!r}] must be a value (string, number, boolean or None) or a list of "
                                 f"values; got {type(x).__name__}")
        out[k] = values
    return out


def _matches(metadata: Mapping, where: dict) -> bool:
    return all(k in metadata and metadata[k] in allowed for k, allowed in where.items())


def check_questions(questions: Sequence[str]) -> list[str]:
    """The questions as a list, each a non-empty string (ValueError naming the first that is not)."""
    from certrag.documents import check_text

    questions = list(questions)
    for i, q in enumerate(questions):
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"questions: question[{i}] must be a non-empty string")
        check_text(q, f"questions: question[{i}]")
    return questions


@dataclass(frozen=True)
class _Candidates:
    """One question's candidates as the index returned them (dense order), before reranking."""

    ids: np.ndarray
    dense: np.ndarray
    chunks: list
    gap: float | None
    skipped: bool  # the adaptive skip rule fired: the dense ranking is decisive


@dataclass(frozen=True)
class _Found:
    ids: list
    scores: list


class Retriever:
    """embed -> HNSW top-N -> rerank -> select, batched over questions. Holds its models (embedder, optional
    reranker) and the config; the store view is an argument of each call, so concurrent calls share nothing
    mutable."""

    def __init__(self, embedder, reranker, config: EngineConfig) -> None:
        self.embedder = embedder
        self.reranker = reranker
        self.config = config

    def retrieve_batch(self, view: StoreView, questions: Sequence[str], *, candidates: int | None = None,
                       selector: Selector | None = None, rerank: bool | str | None = None,
                       where: Mapping | None = None) -> list[Retrieval]:
        """One Retrieval per question (validated by the caller). candidates overrides config.retrieval.candidates
        (N); selector overrides the configured selector; rerank: None follows the config, False skips the
        cross-encoder (the dense scores then rank and feed the selector), True always runs it, "adaptive" runs it
        only where the reranker's skip rule says the dense ranking is not decisive. Asking for more candidates than
        the store holds returns what it has. where: a metadata filter (check_where): the index is searched
        deeper (until N matching chunks are found or the whole store has been searched) and only chunks of
        matching documents are candidates; the trace says how deep (where_searched)."""
        n_cand = candidates if candidates is not None else self.config.retrieval.candidates
        if isinstance(n_cand, bool) or not isinstance(n_cand, int) or n_cand < 1:
            raise ValueError(f"candidates must be a positive integer; got {n_cand!r}")
        if selector is not None and not callable(getattr(selector, "select", None)):
            raise ValueError(f"selector must be a selector object (certrag.select, e.g. GradientSelector()); got "
                             f"{selector!r} (a configured name goes in EngineConfig(selection=SelectionConfig(...)))")
        selector = selector or self.config.selection.make()
        if rerank is None:
            rerank = ("adaptive" if self.config.retrieval.adaptive_rerank else True) \
                if self.config.retrieval.rerank else False
        if rerank not in (True, False, "adaptive"):
            raise ValueError(f"rerank must be True, False, 'adaptive' or None; got {rerank!r}")
        skip_gap = None
        if rerank == "adaptive" and self.reranker is not None:
            rule = getattr(self.reranker, "skip_rule", None)
            if not rule:
                raise ValueError("rerank='adaptive' needs a reranker whose card holds a skip_rule (fit one with "
                                 "`python -m certrag.train.skip_rule`)")
            skip_gap = float(rule["threshold"])
        if not questions:
            return []
        t0 = time.perf_counter()
        q_vec = self.embedder.embed(list(questions))
        t1 = time.perf_counter()
        where = check_where(where)
        k = max(1, min(n_cand, len(view.index)))
        ef = max(self.config.index.ef_search, k)
        found = view.index.search(q_vec, k=k, ef=ef)
        depth = [k] * len(questions)
        if where is not None:
            found, depth = self._filtered(view, q_vec, found, where, n_cand)
        t2 = time.perf_counter()
        embed_ms, search_ms = (t1 - t0) * 1e3 / len(questions), (t2 - t1) * 1e3 / len(questions)
        reranker = self.reranker if rerank is not False else None
        cands = [self._candidates(view, found.ids[qi], found.scores[qi], reranker, skip_gap)
                 for qi in range(len(questions))]
        cross, rerank_ms = self._cross_scores(questions, cands, reranker)
        out = [self._ranked(q, c, cross.get(qi), reranker, selector, embed_ms, search_ms, rerank_ms)
               for qi, (q, c) in enumerate(zip(questions, cands))]
        if where is not None:
            for r, d in zip(out, depth):
                r.trace["where_searched"] = d
        return out

    def _filtered(self, view: StoreView, q_vec: np.ndarray, found, where: dict, n_cand: int):
        """Per question, the first n_cand hits whose document matches `where`, searching 4x deeper each round."""
        ids_out, scores_out, depth = [], [], []
        for qi in range(len(q_vec)):
            k = min(len(view.index), max(4 * n_cand, 64))
            while True:
                hit = view.index.search(q_vec[qi:qi + 1], k=k, ef=max(self.config.index.ef_search, k))
                ids, scores = hit.ids[0], hit.scores[0]
                keep = []
                for j, c in enumerate(ids):
                    pos = view.position.get(int(c))
                    if pos is None:
                        continue
                    doc = view.documents.get(view.chunks[pos]["doc_id"], {})
                    if _matches(doc.get("metadata") or {}, where):
                        keep.append(j)
                        if len(keep) == n_cand:
                            break
                if len(keep) == n_cand or k >= len(view.index):
                    break
                k = min(len(view.index), k * 4)
            ids_out.append(ids[keep])
            scores_out.append(scores[keep])
            depth.append(k)
        return _Found(ids_out, scores_out), depth

    def _candidates(self, view: StoreView, ids: np.ndarray, dense: np.ndarray, reranker,
                    skip_gap: float | None) -> "_Candidates":
        # ids the view does not hold (padding, or vectors a writer added after this view was published) are skipped
        keep = np.array([int(c) in view.position for c in ids], dtype=bool) if len(ids) else np.zeros(0, bool)
        ids, dense = ids[keep], dense[keep]
        if self.config.index.metric == "l2":  # -|q - x|^2 of unit vectors is 2 cos - 2
            dense = (1.0 + dense / 2.0).astype(np.float32)
        chunks = [view.chunks[view.position[int(c)]] for c in ids]
        # the dense lead of the first candidate over the second: the skip rule's feature
        gap = float(dense[0] - dense[1]) if len(dense) > 1 else None
        skipped = reranker is not None and skip_gap is not None and gap is not None and gap >= skip_gap
        return _Candidates(ids, dense, chunks, gap, skipped)

    def _cross_scores(self, questions: Sequence[str], cands: list["_Candidates"], reranker
                      ) -> tuple[dict[int, np.ndarray], float]:
        """The cross-encoder scores of every question's candidates that are to be reranked, in one call (a pair's
        score does not depend on what it is batched with), by question index; and the milliseconds per reranked
        question."""
        todo = [qi for qi, c in enumerate(cands) if reranker is not None and not c.skipped and len(c.ids)]
        if not todo:
            return {}, 0.0
        t = time.perf_counter()
        qs = [questions[qi] for qi in todo for _ in cands[qi].chunks]
        texts = [ch["text"] for qi in todo for ch in cands[qi].chunks]
        flat = np.asarray(reranker.cross_scores(qs, texts, batch_size=self.config.retrieval.rerank_batch),
                          dtype=np.float32)
        out, at = {}, 0
        for qi in todo:
            n = len(cands[qi].chunks)
            out[qi] = flat[at:at + n]
            at += n
        return out, (time.perf_counter() - t) * 1e3 / len(todo)

    def _ranked(self, question: str, c: "_Candidates", cross: np.ndarray | None, reranker, selector,
                embed_ms: float, search_ms: float, rerank_ms: float) -> Retrieval:
        ids, dense, chunks, skipped = c.ids, c.dense, c.chunks, c.skipped
        texts = [ch["text"] for ch in chunks]
        reranker_name = reranker.name if reranker is not None else None
        dense_weight = float(reranker.dense_weight or 0.0) if reranker is not None else 0.0
        if cross is not None:  # the reranker's fused score: ce(q, p) + dense_weight * cos(q, p) (certrag.rerank)
            rerank_scores = (cross + np.float32(dense_weight) * dense).astype(np.float32)
            order = np.argsort(-rerank_scores, kind="stable")
            ranked, kind = rerank_scores[order], "logit"
        elif skipped and dense_weight > 0:
            # cut on the fused score's dense term, w * cos: the logit scale the selector sees for a reranked
            # question (on bare cosines the gradient rule would keep max_k chunks of a decisive ranking)
            rerank_scores = np.full(len(ids), np.nan, dtype=np.float32)
            order = np.arange(len(ids))
            ranked, kind = (dense_weight * dense).astype(np.float32), "logit"
        else:
            rerank_scores = np.full(len(ids), np.nan, dtype=np.float32)
            order = np.arange(len(ids))
            ranked, kind = dense, "cosine"
        t4 = time.perf_counter()
        selected = cut(selector, ranked, kind)
        t5 = time.perf_counter()
        return Retrieval(
            question=question, chunk_ids=ids[order], doc_ids=tuple(chunks[i]["doc_id"] for i in order),
            texts=tuple(texts[i] for i in order), dense_scores=dense[order], rerank_scores=rerank_scores[order],
            selected=int(selected),
            trace={"embed_ms": embed_ms, "search_ms": search_ms, "rerank_ms": rerank_ms if cross is not None else 0.0,
                   "select_ms": (t5 - t4) * 1e3, "candidates": int(len(ids)),
                   "reranker": reranker_name, "reranked": cross is not None,
                   "rerank_skipped": bool(skipped), "dense_gap": c.gap, "selector": selector.name})
