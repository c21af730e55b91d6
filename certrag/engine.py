"""The Engine: documents in, a persistent store on disk, and for each question a ranked, reranked and adaptively cut
set of chunks. Stages are small objects (chunker, embedder, index, reranker, selector) composed here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from certrag.config import EngineConfig
from certrag.documents import Document, load_documents
from certrag.index import HnswIndex
from certrag.select import positive_scores
from certrag.store import StoreData, StoreError, StoreLock, read_store, write_store

log = logging.getLogger(__name__)


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
class Answer:
    """An answer with its evidence and its bill: the chunks it cites, Chain-of-Note's notes where any, the feedback
    rounds, tokens and cost over every LLM call, and the per-stage trace (milliseconds)."""

    question: str
    text: str
    strategy: str
    cited_chunk_ids: tuple[int, ...]
    notes: tuple = ()
    rejected: bool = False
    malformed: bool = False
    rounds: int = 1
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    model: str = ""
    trace: dict = field(default_factory=dict)
    retrieval: Retrieval | None = None
    certification: object = None  # certrag.conformal.Certification when answer(certify=True)
    confidence: float | None = None  # P(supported) from lookback ratios when answer(confidence=True)
    lookback: object = None  # certrag.lookback.LookbackFeatures of the answer's generation, with confidence

    def to_dict(self) -> dict:
        return {"question": self.question, "answer": self.text, "strategy": self.strategy,
                "certification": self.certification.to_dict() if self.certification is not None else None,
                "confidence": self.confidence,
                "cited_chunk_ids": list(self.cited_chunk_ids),
                "notes": [{"passage": n.passage, "kind": n.kind, "text": n.text} for n in self.notes],
                "rejected": self.rejected, "malformed": self.malformed, "rounds": self.rounds,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "cost": self.cost,
                "model": self.model, "trace": self.trace}


@dataclass(frozen=True)
class BuildReport:
    documents: int
    chunks: int
    skipped_empty: tuple[str, ...]
    seconds: float


class Engine:
    """Open with Engine.build(...) or Engine.open(...); use as a context manager or call close()."""

    def __init__(self, path: Path, data: StoreData, config: EngineConfig, *, read_only: bool, embedder=None,
                 reranker=None, lock: StoreLock | None = None) -> None:
        self.path = path
        self.config = config
        self.read_only = read_only
        self._data = data
        self._lock = lock
        self._embedder = embedder
        self._reranker = reranker
        self._llm = None
        self._chunker = None
        self._calibration = None
        self.factuality = None  # certrag.factuality.FactualityClassifier used by answer(confidence=True)
        self._reindex()
        self.last_report: BuildReport | None = None

    def _reindex(self) -> None:
        """Chunk id -> row in chunks / vectors, rebuilt after every write."""
        self._position = {int(c): i for i, c in enumerate(self._data.ids)}

    # ------------------------------------------------------------------------------------------- construction

    @classmethod
    def build(cls, documents: object, path: str | Path, config: EngineConfig | None = None, *,
              embedder=None, reranker=None, overwrite: bool = False, progress: bool = True) -> "Engine":
        """Indexes documents into a new store at path and returns the open engine."""
        path = Path(path)
        config = config or EngineConfig()
        if (path / "CURRENT").exists() and not overwrite:
            raise StoreError(f"{path} already holds a store; open it with Engine.open(...).add(...) or pass "
                             "overwrite=True")
        if path.exists() and not path.is_dir():
            raise StoreError(f"{path} exists and is not a folder")
        docs = load_documents(documents)
        path.mkdir(parents=True, exist_ok=True)
        lock = StoreLock(path)
        try:
            from certrag.conformal import CALIBRATION_FILE

            (path / CALIBRATION_FILE).unlink(missing_ok=True)  # a calibration of the store being replaced
            embedder = embedder or cls._default_embedder(config)
            reranker = cls._resolve_reranker(config, reranker)
            index = HnswIndex(embedder.dim, config.index.metric, config.index.M, config.index.ef_construction)
            data = StoreData(config=config.to_dict(), models=cls._models(embedder, reranker), chunks=[],
                             documents={}, ids=np.zeros(0, np.int64), vectors=np.zeros((0, embedder.dim), np.float32),
                             index=index)
            engine = cls(path, data, config, read_only=False, embedder=embedder, reranker=reranker, lock=lock)
            engine._ingest(docs, progress)
            return engine
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, path: str | Path, read_only: bool = False, *, embedder=None, reranker=None,
             verify: bool = True) -> "Engine":
        """Opens an existing store. verify=False skips the SHA-256 check of every file (sizes are still checked)."""
        from certrag.store import current_version

        path = Path(path)
        current_version(path)  # a clear error for a missing or foreign folder, before any lock file is made
        lock = None if read_only else StoreLock(path)
        try:
            data = read_store(path, verify=verify, mmap=read_only)
            config = EngineConfig.from_dict(data.config)
            embedder = embedder or cls._default_embedder(config)
            if data.models.get("embedder") != embedder.name or data.index.dim != embedder.dim:
                raise StoreError(f"{path} was built with the embedder {data.models.get('embedder')!r} "
                                 f"({data.index.dim}-d); this engine has {embedder.name!r} ({embedder.dim}-d)")
            reranker = cls._resolve_reranker(config, reranker)
            return cls(path, data, config, read_only=read_only, embedder=embedder, reranker=reranker, lock=lock)
        except BaseException:
            if lock:
                lock.release()
            raise

    @staticmethod
    def _default_embedder(config: EngineConfig):
        from certrag.embed import DEFAULT_MODEL, Embedder

        if config.embedder != DEFAULT_MODEL:
            raise ValueError(f"embedder {config.embedder!r} is not bundled; pass an Embedder instance")
        return Embedder.default()

    @staticmethod
    def _resolve_reranker(config: EngineConfig, reranker):
        if not config.retrieval.rerank:
            return None
        if reranker is not None:
            return reranker
        from certrag.rerank import CrossEncoderReranker

        return CrossEncoderReranker.default()

    @staticmethod
    def _models(embedder, reranker) -> dict:
        return {"embedder": embedder.name, "dim": embedder.dim,
                "reranker": getattr(reranker, "name", None) if reranker is not None else None}

    def close(self) -> None:
        if self._lock:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ writing

    @property
    def chunker(self):
        if self._chunker is None:
            from certrag.segment import make_chunker

            self._chunker = make_chunker(self.config.chunker, self.config.segmenter, embedder=self._embedder)
        return self._chunker

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only")
        if self._lock is None:
            raise StoreError(f"{self.path} is closed")

    def _ingest(self, docs: list[Document], progress: bool) -> BuildReport:
        from tqdm.auto import tqdm

        started = time.perf_counter()
        data = self._data
        clash = [d.id for d in docs if d.id in data.documents]
        if clash:
            raise ValueError(f"documents already in the store: {clash[:5]}{' ...' if len(clash) > 5 else ''}; "
                             "remove them first")
        skipped = tuple(d.id for d in docs if not d.text.strip())
        for doc_id in skipped:
            log.warning("skipping empty document %r", doc_id)
        docs = [d for d in docs if d.text.strip()]
        new_chunks, new_docs = [], {}
        next_id = data.next_chunk_id
        for doc in tqdm(docs, desc="segmenting", unit="doc", disable=not progress or len(docs) < 2):
            ids = []
            for c in self.chunker.split(doc.text):
                new_chunks.append({"id": next_id, "doc_id": doc.id, "start": c.start, "end": c.end,
                                   "n_tokens": c.n_tokens, "text": c.text})
                ids.append(next_id)
                next_id += 1
            new_docs[doc.id] = {"metadata": doc.metadata, "chunk_ids": ids, "characters": len(doc.text)}
        texts = [c["text"] for c in new_chunks]
        vectors = np.zeros((0, self._embedder.dim), np.float32)
        if texts:
            batch = 512
            parts = [self._embedder.embed(texts[i:i + batch])
                     for i in tqdm(range(0, len(texts), batch), desc="embedding", unit="batch",
                                   disable=not progress or len(texts) <= batch)]
            vectors = np.concatenate(parts)
        ids = np.array([c["id"] for c in new_chunks], dtype=np.int64)
        if len(ids):
            data.index.add(vectors, ids)
        data.chunks += new_chunks
        data.documents.update(new_docs)
        data.ids = np.concatenate([data.ids, ids])
        data.vectors = np.concatenate([data.vectors, vectors]) if len(vectors) else data.vectors
        data.next_chunk_id = next_id
        write_store(self.path, data)
        self._reindex()
        report = BuildReport(documents=len(docs), chunks=len(new_chunks), skipped_empty=skipped,
                             seconds=time.perf_counter() - started)
        self.last_report = report
        return report

    def add(self, documents: object, progress: bool = True) -> BuildReport:
        """Segments, embeds and indexes new documents, then writes a new store version atomically."""
        self._writable()
        return self._ingest(load_documents(documents), progress)

    def remove(self, doc_ids: Sequence[str] | str) -> int:
        """Removes documents and their chunks; returns how many chunks went. Unknown ids raise ValueError."""
        self._writable()
        if isinstance(doc_ids, str):
            doc_ids = [doc_ids]
        doc_ids = list(dict.fromkeys(doc_ids))
        unknown = [d for d in doc_ids if d not in self._data.documents]
        if unknown:
            raise ValueError(f"unknown document ids: {unknown[:5]}")
        data = self._data
        gone = {cid for d in doc_ids for cid in data.documents[d]["chunk_ids"]}
        data.index.remove(np.array(sorted(gone), dtype=np.int64))
        keep = np.array([int(c) not in gone for c in data.ids], dtype=bool)
        data.chunks = [c for c, k in zip(data.chunks, keep) if k]
        data.ids, data.vectors = data.ids[keep], data.vectors[keep]
        for d in doc_ids:
            del data.documents[d]
        write_store(self.path, data)
        self._reindex()
        return len(gone)

    # ------------------------------------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._data.chunks)

    @property
    def documents(self) -> list[str]:
        return list(self._data.documents)

    def chunk(self, chunk_id: int) -> dict:
        return dict(self._data.chunks[self._position[int(chunk_id)]])

    def info(self) -> dict:
        m = self._data.manifest
        return {"path": str(self.path), "format_version": m.get("format_version"), "written": m.get("written"),
                "documents": len(self._data.documents), "chunks": len(self._data.chunks),
                "models": self._data.models, "config": self.config.to_dict(),
                "index": {k: v for k, v in self._data.index.stats().items() if k != "nodes_per_level"},
                "calibration": self._calibration_summary()}

    def _calibration_summary(self) -> dict | None:
        from certrag.conformal import CalibrationError

        try:
            cal = self.calibration
        except CalibrationError as exc:
            return {"error": str(exc)}
        if cal is None:
            return None
        d = cal.diagnostics
        return {"alpha": cal.alpha, "s_thres": cal.s_thres, "n": cal.n, "holds": d.holds,
                "coverage": d.coverage, "m1": d.m1, "m2": d.m2, "created": cal.created}

    # ------------------------------------------------------------------------------------- certified retrieval

    @property
    def embedder_name(self) -> str:
        return self._data.models.get("embedder")

    def reranker_identity(self) -> dict | None:
        if self._reranker is None:
            return None
        identity = getattr(self._reranker, "identity", None)
        return dict(identity) if identity is not None else {"name": getattr(self._reranker, "name", "reranker")}

    @property
    def calibration(self):
        """The stored conformal calibration (certrag.conformal.Calibration), or None when the store has none."""
        from certrag.conformal import CALIBRATION_FILE, Calibration

        if self._calibration is None and (self.path / CALIBRATION_FILE).exists():
            self._calibration = Calibration.load(self.path / CALIBRATION_FILE)
        return self._calibration

    def set_calibration(self, calibration) -> None:
        """Stores a calibration with the store (atomically), after checking it matches this engine's models."""
        from certrag.conformal import CALIBRATION_FILE

        self._writable()
        calibration.check_identity(self.embedder_name, self.reranker_identity())
        calibration.save(self.path / CALIBRATION_FILE)
        self._calibration = calibration

    def calibrate(self, data: object, *, alpha: float = 0.1, holdout: float = 0.3, eval_data: object = None,
                  save: bool = True, progress: bool = True, **judge):
        """Conformal calibration of the retrieval scores (certrag.conformal.calibrate) on data: a JSONL path,
        'nq-open:calibration', or a list of items. Stored with the store unless save=False; returns the record."""
        from certrag.conformal import calibrate

        if save:
            self._writable()
        record, _, _ = calibrate(self, data, alpha=alpha, holdout=holdout, eval_data=eval_data, progress=progress,
                                 **judge)
        if save:
            self.set_calibration(record)
        return record

    def certify(self, retrieval: Retrieval, *, force: bool = False):
        """Marks each candidate trusted or not under the stored calibration. applied is True when the diagnostics
        say the guarantee holds (or force): only then should the context shrink to the trusted candidates."""
        from certrag.conformal import CalibrationError, Certification, calibrated_scores

        cal = self.calibration
        if cal is None:
            raise CalibrationError(f"{self.path} has no calibration: run `certrag calibrate` (or "
                                   "engine.calibrate) first")
        cal.check_identity(self.embedder_name, self.reranker_identity())
        scores = calibrated_scores(retrieval.rerank_scores, retrieval.dense_scores, cal.score_transform)
        trusted = cal.trusted(scores)
        stale = (f"; the store has changed since calibration ({cal.chunks:,} -> {len(self):,} chunks): recalibrate"
                 if cal.chunks is not None and cal.chunks != len(self) else "")
        if cal.holds or force:
            return Certification(scores=scores, trusted=trusted, s_thres=cal.s_thres, alpha=cal.alpha, applied=True,
                                 reason=(("forced although the guarantee does not hold" if not cal.holds else "")
                                         + stale).lstrip("; "))
        return Certification(scores=scores, trusted=trusted, s_thres=cal.s_thres, alpha=cal.alpha, applied=False,
                             reason="the guarantee does not hold for this retriever and data: "
                                    + "; ".join(cal.diagnostics.reasons) + stale)

    @property
    def llm(self):
        if self._llm is None:
            from certrag.llm import LocalLLM

            self._llm = LocalLLM()
        return self._llm

    @llm.setter
    def llm(self, value) -> None:
        self._llm = value

    def answer(self, question: str, strategy="plain", *, qtype: str = "open",
               options: list[str] | None = None, prices=None, max_new_tokens: int | None = None,
               certify: bool = False, force_certify: bool = False, confidence: bool = False) -> Answer:
        """Retrieves, then answers with a strategy: plain, chain_of_note, self_rag, feedback (SAGE's loop around
        plain) or feedback:chain_of_note -- or a configured strategy object such as SelfRag(delta=0.5). The feedback
        loop re-selects from the same reranked candidates with min_k moved by
        the model's flag, so retrieval runs once. max_new_tokens overrides the strategy's budget (for
        chain_of_note it is per passage).

        certify=True marks every candidate trusted or not under the store's conformal calibration and, when its
        diagnostics say the guarantee holds (or force_certify=True), sends the trusted candidates instead of the
        selector's cut (at most selection.max_k); with none trusted the answer is "unknown", counted as a rejection,
        and no LLM call is made.

        confidence=True records lookback ratios while the local model writes the answer and fills Answer.confidence
        with the factuality classifier's P(supported) (engine.factuality; by default the one shipped for the
        model)."""
        from certrag.strategies import STRATEGIES

        if not isinstance(strategy, str):  # a configured strategy object (anything with run(...) and a name)
            if not callable(getattr(strategy, "run", None)):
                raise ValueError(f"strategy must be a name or an object with a run method; got {strategy!r}")
            name = getattr(strategy, "name", type(strategy).__name__)
            return self._answer_with(strategy, False, question, name, qtype, options, prices, certify,
                                     force_certify, confidence)
        base_name, feedback = strategy, False
        if strategy.startswith("feedback"):
            feedback, _, base_name = strategy.partition(":")
            base_name = base_name or "plain"
        if base_name not in STRATEGIES:
            raise ValueError(f"strategy must be plain, chain_of_note, self_rag, feedback or feedback:<base>; got "
                             f"{strategy!r}")
        base = STRATEGIES[base_name]() if max_new_tokens is None else STRATEGIES[base_name](max_new_tokens=max_new_tokens)
        return self._answer_with(base, bool(feedback), question, strategy, qtype, options, prices, certify,
                                 force_certify, confidence)

    def _answer_with(self, base, feedback: bool, question: str, strategy: str, qtype: str, options, prices,
                     certify: bool, force_certify: bool, confidence: bool) -> Answer:
        import dataclasses as dc

        from certrag.cost import PriceTable
        from certrag.llm.prompts import Passage

        t0 = time.perf_counter()
        r = self.retrieve(question)
        certification, limit = None, len(r.chunk_ids)
        if certify or force_certify:
            certification = self.certify(r, force=force_certify)
            if certification.applied:
                limit = min(certification.trusted_count, self.config.selection.max_k)
                r = dc.replace(r, selected=limit)
                if limit == 0:
                    trace = dict(r.trace, retrieve_ms=(time.perf_counter() - t0) * 1e3, generate_ms=0.0,
                                 llm_calls=0, history=[])
                    return Answer(question=question, text="unknown", strategy=strategy, cited_chunk_ids=(),
                                  rejected=True, model=getattr(self._llm, "name", ""), trace=trace, retrieval=r,
                                  certification=certification)
        t1 = time.perf_counter()
        positive = (positive_scores(r.rerank_scores, "logit") if not np.isnan(r.rerank_scores).all()
                    else positive_scores(r.dense_scores, "cosine"))

        def passages_for(n: int) -> list:
            return [Passage(text=r.texts[i], chunk_id=int(r.chunk_ids[i])) for i in range(n)]

        llm = self.llm
        classifier = self._factuality_for(llm) if confidence else None
        recording_before = getattr(llm, "record_lookback", False)
        if confidence:
            llm.record_lookback = True
        try:
            result = self._run_strategy(base, feedback, question, r, llm, passages_for, positive, limit, qtype,
                                        options)
        finally:
            if confidence:
                llm.record_lookback = recording_before
        t2 = time.perf_counter()
        conf = features = None
        if confidence and result.answer_call is not None and result.calls:
            features = result.calls[result.answer_call].lookback
            if features is not None:
                conf = classifier.predict(features)
        used = result.passages_used
        cited = tuple(int(r.chunk_ids[i]) for i in range(used))
        if result.cited is not None:
            cited = tuple(int(r.chunk_ids[i]) for i in result.cited if 0 <= i < used)
        elif result.notes and not result.malformed:
            useful = {n.passage for n in result.notes if n.kind in ("answers", "context")}
            cited = tuple(int(r.chunk_ids[i - 1]) for i in sorted(useful) if 1 <= i <= used)
        model = getattr(llm, "name", "llm")
        cost = (prices or PriceTable()).cost(model, result.input_tokens, result.output_tokens)
        trace = dict(r.trace, retrieve_ms=(t1 - t0) * 1e3, generate_ms=(t2 - t1) * 1e3, llm_calls=len(result.calls),
                     history=list(result.history))
        return Answer(question=question, text=result.text, strategy=strategy, cited_chunk_ids=cited,
                      notes=result.notes, rejected=result.rejected, malformed=result.malformed, rounds=result.rounds,
                      input_tokens=result.input_tokens, output_tokens=result.output_tokens, cost=cost, model=model,
                      trace=trace, retrieval=r, certification=certification, confidence=conf, lookback=features)

    def _run_strategy(self, base, feedback: bool, question: str, r: Retrieval, llm, passages_for, positive,
                      limit: int, qtype: str, options):
        import dataclasses as dc

        from certrag.strategies import Feedback

        if not feedback:
            return base.run(question, passages_for(r.selected), llm, qtype, options)
        gradient = dc.replace(self.config.selection, method="gradient")

        def retrieve_k(min_k: int) -> list:
            sel = dc.replace(gradient, min_k=min_k, max_k=max(min_k, gradient.max_k)).make()
            return passages_for(min(sel.select(positive), limit))

        return Feedback(base=base).run_adaptive(question, retrieve_k, llm, min(self.config.selection.min_k, limit),
                                                qtype, options, max_k=limit or 1)

    def _factuality_for(self, llm):
        """The factuality classifier for llm: engine.factuality when set, else the one shipped for the model."""
        if not hasattr(llm, "record_lookback"):
            raise ValueError("confidence needs a local model (certrag LocalLLM): it reads the model's attention")
        if self.factuality is None:
            from certrag.factuality import FactualityClassifier

            self.factuality = FactualityClassifier.for_model(getattr(llm, "name", ""))
        return self.factuality

    def retrieve(self, question: str | Sequence[str], *, candidates: int | None = None,
                 selector=None, rerank: bool | None = None) -> "Retrieval | list[Retrieval]":
        """Embeds, searches, reranks and selects. A string gives one Retrieval; a list gives a list, run batched.

        candidates overrides config.retrieval.candidates (N); selector overrides the configured selector; rerank=False
        skips the cross-encoder for this call (the dense scores then rank and feed the selector). Asking for more
        candidates than the store holds returns what it has.
        """
        single = isinstance(question, str)
        questions = [question] if single else list(question)
        for i, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"question{'' if single else f'[{i}]'} must be a non-empty string")
        n_cand = candidates if candidates is not None else self.config.retrieval.candidates
        if isinstance(n_cand, bool) or not isinstance(n_cand, int) or n_cand < 1:
            raise ValueError(f"candidates must be a positive integer; got {n_cand!r}")
        selector = selector or self.config.selection.make()
        if not questions:
            return []
        t0 = time.perf_counter()
        q_vec = self._embedder.embed(questions)
        t1 = time.perf_counter()
        k = max(1, min(n_cand, len(self._data.index)))
        ef = max(self.config.index.ef_search, k)
        found = self._data.index.search(q_vec, k=k, ef=ef)
        t2 = time.perf_counter()
        embed_ms, search_ms = (t1 - t0) * 1e3 / len(questions), (t2 - t1) * 1e3 / len(questions)
        out = []
        for qi, q in enumerate(questions):
            valid = found.ids[qi] >= 0
            ids, dense = found.ids[qi][valid], found.scores[qi][valid]
            if self.config.index.metric == "l2":  # -|q - x|^2 of unit vectors is 2 cos - 2
                dense = (1.0 + dense / 2.0).astype(np.float32)
            chunks = [self._data.chunks[self._position[int(c)]] for c in ids]
            texts = [c["text"] for c in chunks]
            t3 = time.perf_counter()
            if self._reranker is not None and rerank is not False and len(ids):
                rerank_scores = self._reranker.score(q, texts, dense).astype(np.float32)
                order = np.argsort(-rerank_scores, kind="stable")
                positive = positive_scores(rerank_scores[order], "logit")
            else:
                rerank_scores = np.full(len(ids), np.nan, dtype=np.float32)
                order = np.arange(len(ids))
                positive = positive_scores(dense, "cosine")
            t4 = time.perf_counter()
            selected = selector.select(positive)
            t5 = time.perf_counter()
            out.append(Retrieval(
                question=q, chunk_ids=ids[order], doc_ids=tuple(chunks[i]["doc_id"] for i in order),
                texts=tuple(texts[i] for i in order), dense_scores=dense[order], rerank_scores=rerank_scores[order],
                selected=int(selected),
                trace={"embed_ms": embed_ms, "search_ms": search_ms, "rerank_ms": (t4 - t3) * 1e3,
                       "select_ms": (t5 - t4) * 1e3, "candidates": int(len(ids)),
                       "reranker": getattr(self._reranker, "name", None) if rerank is not False else None,
                       "selector": selector.name}))
        return out[0] if single else out
