"""The Engine composes the stages: documents in, a persistent store on disk, and for each question a ranked,
reranked and adaptively cut set of chunks (certrag.retrieval), answered by a strategy (certrag.answering,
certrag.strategies) and certified (certrag.certify).

Concurrency contract: retrieve, retrieve_batch and answer may run at once from any number of threads; each reads
the store view that was current when it started (an immutable StoreView: index, chunk table, position map) and
carries its own per-request options. One writer (add, remove, set_calibration) at a time per engine, and one
writable engine per store (a file lock): a write builds the new version beside the live one and publishes its view
in one assignment when the version is on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from certrag.answering import Answer, AnswerOptions, answer as answer_from
from certrag.config import EngineConfig
from certrag.documents import Document, check_text, load_documents
from certrag.index import HnswIndex
from certrag.retrieval import Retrieval, Retriever, StoreView, check_questions
from certrag.shards import ShardedIndex
from certrag.stages import Stages
from certrag.store import (StoreData, StoreError, StoreLock, foreign_entries, read_manifest, read_store,
                           write_store)

log = logging.getLogger(__name__)

__all__ = ["Answer", "AnswerOptions", "BuildReport", "Engine", "Retrieval", "SyncReport"]


@dataclass(frozen=True)
class BuildReport:
    documents: int
    chunks: int
    skipped_empty: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class SyncReport:
    """What Engine.sync did: documents added, replaced (changed content), removed (cleanup), left unchanged, and the
    chunks it indexed."""

    added: int
    replaced: int
    removed: int
    unchanged: int
    chunks: int
    seconds: float


def content_hash(doc: Document) -> str:
    """SHA-256 of a document's text and metadata: what Engine.sync compares."""
    import hashlib
    import json

    payload = json.dumps({"text": doc.text, "metadata": doc.metadata}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()


def _backend_of(model) -> dict | None:
    backend = getattr(model, "backend", None)
    return backend.as_dict() if hasattr(backend, "as_dict") else None


def _with_reranker(config: dict, models: dict) -> dict:
    """A stored config as it was built: one saved before the reranker was a config field names none, and was reranked
    by the one reranker there was then (the 6-layer one; its name is in the store's models), not today's default."""
    from certrag.rerank import L6_RERANKER, PACKAGE_RERANKERS

    if not isinstance(config, dict) or "reranker" in config:
        return config
    recorded = models.get("reranker") if isinstance(models, dict) else None
    return {**config, "reranker": recorded if recorded in PACKAGE_RERANKERS else L6_RERANKER}


class Engine:
    """Open with Engine.build(...) or Engine.open(...); use as a context manager or call close()."""

    def __init__(self, path: Path, data: StoreData, config: EngineConfig, *, read_only: bool, stages: Stages,
                 lock: StoreLock | None = None, build_report: BuildReport | None = None) -> None:
        self.path = path
        self.config = config
        self.read_only = read_only
        self.stages = stages
        self.build_report = build_report  # what the build (or Ray ingest) that made this engine object indexed
        self._data = data
        self._lock = lock
        self._retriever = Retriever(stages.embedder, stages.reranker, config)
        self._default_llm = None
        self._judges = {}  # (model, weights) -> the LocalLLM that judges answer presence, loaded on first use
        self._judge_lock = threading.Lock()  # held while a judge loads, never during a request
        self._chunker = None
        self._calibration = None
        self.factuality = None  # a FactualityClassifier to use for every model; None: the one shipped per model
        self.presence = None  # a certrag.certify.presence.PresenceRule for judge_support; None: the one shipped
        self._view = self._publish()
        self._write_lock = threading.Lock()  # one write at a time; readers never take it

    @property
    def embedder(self):
        """The stage that embeds questions and chunks (certrag.protocols.Embedder)."""
        return self.stages.embedder

    @property
    def reranker(self):
        """The cross-encoder stage (certrag.protocols.Reranker), or None when the config turns reranking off."""
        return self.stages.reranker

    def _publish(self) -> StoreView:
        """The readers' view of the store as written: a new chunk list and position map (chunk id -> row), never
        changed afterwards. Assigning it to self._view is the moment readers switch versions."""
        data = self._data
        self._view = StoreView(index=data.index, chunks=list(data.chunks),
                               position={int(c): i for i, c in enumerate(data.ids)}, documents=data.documents)
        return self._view

    # ------------------------------------------------------------------------------------------- construction

    @classmethod
    def build(cls, documents: object, path: str | Path, config: EngineConfig | None = None, *,
              stages: Stages | None = None, embedder=None, reranker=None, overwrite: bool = False,
              force: bool = False, progress: bool = True) -> "Engine":
        """Indexes documents into a new store at path and returns the open engine. On any error nothing is left
        behind: a folder this call made is removed, and a store being overwritten keeps its current version.

        path must be new, an empty folder or a store (overwrite=True to replace it). A folder that holds other
        things is refused unless force=True, which builds the store beside them; a store deletes only what it
        wrote itself (certrag.store.write_store), so nothing else in the folder is touched either way.

        stages: the models (certrag.stages.Stages; default: Stages.default(config)); embedder= / reranker= replace
        one of the defaults. The engine's build_report says what was indexed."""
        docs = load_documents(documents)
        return cls.build_from(lambda engine: engine._ingest(docs, progress), path, config, stages=stages,
                              embedder=embedder, reranker=reranker, overwrite=overwrite, force=force)

    @classmethod
    def build_from(cls, fill, path: str | Path, config: EngineConfig | None = None, *,
                   stages: Stages | None = None, embedder=None, reranker=None, overwrite: bool = False,
                   force: bool = False) -> "Engine":
        """A new store at path, holding what fill(engine) adds to the empty engine (engine.add or
        engine.add_prepared; written once, at the end; certrag.scale.indexing fills it from a Ray Data job).
        Otherwise as build()."""
        import shutil

        path = Path(path)
        config = config or EngineConfig()
        if (path / "CURRENT").exists() and not overwrite:
            raise StoreError(f"{path} already holds a store; open it with Engine.open(...).add(...) or pass "
                             "overwrite=True")
        if path.exists() and not path.is_dir():
            raise StoreError(f"{path} exists and is not a folder")
        if not (path / "CURRENT").exists() and not force:
            other = foreign_entries(path)
            if other:
                shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
                raise StoreError(f"{path} is not empty ({shown}) and holds no store: a store is built in a new or "
                                 "empty folder; pass force=True (certrag index --force) to build it beside them")
        made = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        try:
            lock = StoreLock(path)
        except BaseException:
            if made:
                shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            from certrag.certify.conformal import CALIBRATION_FILE

            stages = _stages(config, stages, embedder, reranker)
            embedder = stages.embedder
            ic = config.index
            index = HnswIndex(embedder.dim, ic.metric, ic.M, ic.ef_construction) if ic.shards == 1 else \
                ShardedIndex.empty(ic.shards, embedder.dim, ic.metric, ic.M, ic.ef_construction)
            data = StoreData(config=config.to_dict(), models=cls._models(embedder, stages.reranker), chunks=[],
                             documents={}, ids=np.zeros(0, np.int64), vectors=np.zeros((0, embedder.dim), np.float32),
                             index=index)
            engine = cls(path, data, config, read_only=False, stages=stages, lock=lock)
            report = fill(engine)
            engine.build_report = report if isinstance(report, BuildReport) else None
            (path / CALIBRATION_FILE).unlink(missing_ok=True)  # a calibration of the store just replaced
            return engine
        except BaseException:
            lock.release()
            if made:
                shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def open(cls, path: str | Path, read_only: bool = False, *, stages: Stages | None = None, embedder=None,
             reranker=None, verify: bool = True, shard_actors: bool = False) -> "Engine":
        """Opens an existing store. verify=False skips the SHA-256 check of every file (sizes are still checked).
        shard_actors=True (read-only; Ray initialised, certrag.scale.connect): the index's shards are loaded by
        one Ray actor each instead of into this process (certrag.shards.RayShardedIndex). stages, embedder,
        reranker: as in build (the embedder must be the one the store was built with)."""
        from certrag.store import current_version

        path = Path(path)
        current_version(path)  # a clear error for a missing or foreign folder, before any lock file is made
        lock = None if read_only else StoreLock(path)
        try:
            if shard_actors and not read_only:
                raise ValueError("shard_actors=True serves a store read-only: pass read_only=True")
            data = read_store(path, verify=verify, mmap=read_only, load_index=not shard_actors)
            if shard_actors:
                from certrag.shards import RayShardedIndex

                data.index = RayShardedIndex(data.index_paths, data.manifest.get("index", {}).get("live"))
            try:
                config = EngineConfig.from_dict(_with_reranker(data.config, data.models))
            except (ValueError, TypeError) as exc:
                raise StoreError(f"{path}: the stored config is damaged ({exc})") from None
            stages = _stages(config, stages, embedder, reranker)
            embedder = stages.embedder
            dim = data.vectors.shape[1]
            if data.models.get("embedder") != embedder.name or dim != embedder.dim:
                raise StoreError(f"{path} was built with the embedder {data.models.get('embedder')!r} "
                                 f"({dim}-d); this engine has {embedder.name!r} ({embedder.dim}-d)")
            return cls(path, data, config, read_only=read_only, stages=stages, lock=lock)
        except BaseException:
            if lock:
                lock.release()
            raise

    @staticmethod
    def _models(embedder, reranker) -> dict:
        return {"embedder": embedder.name, "dim": embedder.dim,
                "reranker": getattr(reranker, "name", None) if reranker is not None else None}

    def with_stages(self, stages: Stages) -> "Engine":
        """A read-only engine over this one's current store version that runs on other stages (an entry point's
        wrapped models: the server's batching views). The data, the calibration and the factuality classifier are
        shared, nothing is copied; stages.llm None keeps this engine's model. Writes made later through this engine
        are not seen by the other."""
        if stages.llm is None and self.stages.llm is not None:
            stages = stages.replace(llm=self.stages.llm)
        return self._sibling(self.config, stages)

    def with_settings(self, *, retrieval=None, selection=None) -> "Engine":
        """A read-only engine over this one's current store version with other per-call settings: retrieval
        (RetrievalConfig) and selection (SelectionConfig), each None to keep this engine's. A store keeps the
        settings it was built with, so a store made before a default changed keeps the old one until it is replaced
        here; what the store holds (chunker, segmenter, embedder, index) is fixed at build."""
        from certrag.config import RetrievalConfig, SelectionConfig

        if retrieval is not None and not isinstance(retrieval, RetrievalConfig):
            raise TypeError(f"retrieval must be a RetrievalConfig; got {type(retrieval).__name__}")
        if selection is not None and not isinstance(selection, SelectionConfig):
            raise TypeError(f"selection must be a SelectionConfig; got {type(selection).__name__}")
        config = dataclasses.replace(self.config, retrieval=retrieval or self.config.retrieval,
                                     selection=selection or self.config.selection)
        return self._sibling(config, self.stages)

    def _sibling(self, config: EngineConfig, stages: Stages) -> "Engine":
        """A read-only engine sharing this one's store version, calibration, default model and classifier."""
        other = Engine(self.path, self._data, config, read_only=True, stages=stages)
        other._default_llm = self._default_llm
        other._judges, other._judge_lock = self._judges, self._judge_lock
        other._calibration = self._calibration
        other.factuality = self.factuality
        other.presence = self.presence
        return other

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

            self._chunker = make_chunker(self.config.chunker, self.config.segmenter, embedder=self.embedder)
        return self._chunker

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only")
        if self._lock is None:
            raise StoreError(f"{self.path} is closed")

    def _ingest(self, docs: list[Document], progress: bool) -> BuildReport:
        from tqdm.auto import tqdm

        from certrag.ingest import GROUP, prepare

        self._check_new([d.id for d in docs])

        def groups():
            with tqdm(total=len(docs), desc="indexing", unit="doc", disable=not progress or len(docs) < 2) as bar:
                for g in range(0, len(docs), GROUP):
                    batch = docs[g:g + GROUP]
                    yield from prepare(batch, self.chunker, self.embedder)
                    bar.update(len(batch))

        return self._ingest_prepared(groups())

    def _check_new(self, doc_ids: Sequence[str]) -> None:
        clash = [d for d in doc_ids if d in self._data.documents]
        if clash:
            raise ValueError(f"documents already in the store: {clash[:5]}{' ...' if len(clash) > 5 else ''}; "
                             "remove them first")

    def add_prepared(self, prepared) -> BuildReport:
        """Adds documents already segmented and embedded elsewhere (certrag.ingest.Prepared, in document order,
        made with this store's chunker and embedder: certrag.scale.indexing's Ray workers), then writes a new store
        version atomically."""
        self._writable()
        with self._write_lock:
            return self._ingest_prepared(prepared)

    def _ingest_prepared(self, prepared) -> BuildReport:
        """Gives the chunks of segmented and embedded documents (certrag.ingest.Prepared, in document order) their
        ids, adds them to the index and writes the store's next version. Nothing is written until the last
        document has come: an error on the way (a worker that failed for good) leaves the store as it was."""
        started = time.perf_counter()
        data = self._data
        new_chunks, new_docs, parts, skipped, seen = [], {}, [], [], set()
        next_id = data.next_chunk_id
        for p in prepared:
            doc = p.doc
            if doc.id in seen or doc.id in data.documents:
                self._check_new([doc.id])
                raise ValueError(f"document id {doc.id!r} appears more than once")
            seen.add(doc.id)
            if not doc.text.strip():
                log.warning("skipping empty document %r", doc.id)
                skipped.append(doc.id)
                continue
            ids = list(range(next_id, next_id + len(p.chunks)))
            new_chunks += [{"id": i, "doc_id": doc.id, **c} for i, c in zip(ids, p.chunks)]
            new_docs[doc.id] = {"metadata": doc.metadata, "chunk_ids": ids, "characters": len(doc.text),
                                "sha256": content_hash(doc)}
            next_id += len(ids)
            if len(p.chunks):
                parts.append(p.vectors)
        vectors = np.concatenate(parts) if parts else np.zeros((0, self.embedder.dim), np.float32)
        ids = np.array([c["id"] for c in new_chunks], dtype=np.int64)
        if len(ids):
            self._index_add(vectors, ids, [c["doc_id"] for c in new_chunks])
        data.chunks = data.chunks + new_chunks
        data.documents = {**data.documents, **new_docs}
        data.ids = np.concatenate([data.ids, ids])
        data.vectors = np.concatenate([data.vectors, vectors]) if len(vectors) else data.vectors
        data.next_chunk_id = next_id
        self._commit()
        report = BuildReport(documents=len(new_docs), chunks=len(new_chunks), skipped_empty=tuple(skipped),
                             seconds=time.perf_counter() - started)
        return report

    def _index_add(self, vectors: np.ndarray, ids: np.ndarray, doc_ids: list[str]) -> None:
        index = self._data.index
        if not isinstance(index, ShardedIndex):
            index.add(vectors, ids)
            return
        try:
            index.add(vectors, ids, doc_ids)
        except BaseException:  # shards before the one that refused changed: go back to the version on disk
            if (self.path / "CURRENT").exists():
                self._data = read_store(self.path, mmap=False)
                self._publish()
            raise

    def _commit(self) -> None:
        """Writes the changed store as its next version and publishes its view. When the write fails (a full disk,
        a kill), the engine goes back to the version on disk, so memory never holds what the store does not."""
        try:
            write_store(self.path, self._data)
        except BaseException:
            try:
                self._data = read_store(self.path, mmap=False)
                self._publish()
            except (StoreError, OSError):
                pass  # nothing on disk to go back to: a build that failed leaves no engine to use
            raise
        self._publish()

    def add(self, documents: object, progress: bool = True) -> BuildReport:
        """Segments, embeds and indexes new documents, then writes a new store version atomically."""
        self._writable()
        docs = load_documents(documents)
        with self._write_lock:
            return self._ingest(docs, progress)

    def remove(self, doc_ids: Sequence[str] | str) -> int:
        """Removes documents and their chunks; returns how many chunks went. Unknown ids raise ValueError."""
        self._writable()
        with self._write_lock:
            return self._remove(doc_ids)

    def upsert(self, documents: object, progress: bool = True) -> BuildReport:
        """add() where a document whose id the store holds replaces it: its old chunks go and the new text is
        indexed, in one new store version (readers see the old document or the new one, never neither)."""
        self._writable()
        docs = load_documents(documents)
        with self._write_lock:
            present = [d.id for d in docs if d.id in self._data.documents]
            try:
                if present:
                    self._remove(present, commit=False)
                return self._ingest(docs, progress)
            except BaseException:
                if present:  # memory goes back to the version on disk (the old documents)
                    self._data = read_store(self.path, mmap=False)
                    self._publish()
                raise

    def sync(self, documents: object, *, cleanup: bool = False, progress: bool = True) -> "SyncReport":
        """Brings the store up to date with documents, by content: a document the store does not hold is added, one
        whose text or metadata changed (their SHA-256) is replaced, an unchanged one is left as it is; cleanup=True
        also removes every document of the store that is not among documents (the store then holds exactly them).
        One new store version at most (none when nothing changed); readers see the old set or the new one."""
        self._writable()
        docs = load_documents(documents)
        with self._write_lock:
            held = self._data.documents
            given = {d.id for d in docs}
            new = [d for d in docs if d.id not in held]
            changed = [d for d in docs if d.id in held and held[d.id].get("sha256") != content_hash(d)]
            gone = [i for i in held if i not in given] if cleanup else []
            going = [d.id for d in changed] + gone
            if not new and not going:
                return SyncReport(added=0, replaced=0, removed=0, unchanged=len(docs), chunks=0, seconds=0.0)
            try:
                if going:
                    self._remove(going, commit=not (new or changed))
                report = self._ingest(new + changed, progress) if new or changed else None
            except BaseException:
                if going:  # memory goes back to the version on disk
                    self._data = read_store(self.path, mmap=False)
                    self._publish()
                raise
            return SyncReport(added=len(new), replaced=len(changed), removed=len(gone),
                              unchanged=len(docs) - len(new) - len(changed),
                              chunks=report.chunks if report else 0, seconds=report.seconds if report else 0.0)

    def _remove(self, doc_ids: Sequence[str] | str, commit: bool = True) -> int:
        if isinstance(doc_ids, str):
            doc_ids = [doc_ids]
        if not isinstance(doc_ids, Iterable) or isinstance(doc_ids, (bytes, dict)):
            raise ValueError(f"doc_ids must be a document id or a list of them; got {type(doc_ids).__name__}")
        doc_ids = list(doc_ids)
        bad = [d for d in doc_ids if not isinstance(d, str)]
        if bad:
            raise ValueError(f"doc_ids must be strings; got {bad[0]!r}")
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
        going = set(doc_ids)
        data.documents = {k: v for k, v in data.documents.items() if k not in going}
        if commit:
            self._commit()
        return len(gone)

    # ------------------------------------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._view)

    @property
    def documents(self) -> list[str]:
        return list(self._data.documents)

    def metadata(self, doc_id: str) -> dict:
        """A document's own metadata, as it was indexed (KeyError for an id the store does not hold)."""
        return dict(self._view.documents[doc_id].get("metadata") or {})

    def chunk(self, chunk_id: int) -> dict:
        view = self._view
        return dict(view.chunks[view.position[int(chunk_id)]])

    def info(self) -> dict:
        m = self._data.manifest
        return {"path": str(self.path), "format_version": m.get("format_version"), "written": m.get("written"),
                "documents": len(self._data.documents), "chunks": len(self._data.chunks),
                "models": self._data.models, "config": self.config.to_dict(),
                "encoders": {"embedder": _backend_of(self.embedder), "reranker": _backend_of(self.reranker)},
                "index": {k: v for k, v in self._data.index.stats().items() if k != "nodes_per_level"},
                "calibration": self._calibration_summary()}

    def _calibration_summary(self) -> dict | None:
        from certrag.certify.conformal import CalibrationError

        try:
            cal = self.calibration
        except CalibrationError as exc:
            return {"error": str(exc)}
        return calibration_summary(cal)

    # ------------------------------------------------------------------------------------- certified retrieval

    @property
    def embedder_name(self) -> str:
        return self._data.models.get("embedder")

    def reranker_identity(self) -> dict | None:
        if self.reranker is None:
            return None
        return dict(self.reranker.identity)

    def reranker_backend(self) -> str | None:
        """The numeric backend the reranker runs in (float32, bfloat16, int8); None without a reranker, or when it
        does not say."""
        described = _backend_of(self.reranker)
        return described.get("backend") if isinstance(described, dict) else None

    @property
    def calibration(self):
        """The store's conformal calibration (certrag.certify.conformal.Calibration); when it has none of its own,
        the default shipped with its reranker (made on NQ-open: its source says so, and certification says it was
        not made on this store), or None when no default fits the store's embedder and reranker."""
        from certrag.certify.conformal import CALIBRATION_FILE, Calibration

        if self._calibration is None and (self.path / CALIBRATION_FILE).exists():
            self._calibration = Calibration.load(self.path / CALIBRATION_FILE)
        if self._calibration is not None:
            return self._calibration
        return default_calibration(self.embedder_name, self.reranker_identity())

    def support(self, r: Retrieval, *, judge: bool = False, llm=None) -> dict | None:
        """Whether retrieval found anything the calibration trusts for this question: the best candidate's score
        against the calibration's threshold (a question whose answer the store does not hold scores far below it).
        None without a calibration, or when the retrieval has no scores on its scale (the reranker skipped).

        judge=True: also asks a reader whether the best candidate states the answer, and lets the answer-presence
        rule shipped with the reranker decide (certrag.certify.presence: the best score and the reader's log-odds,
        fitted on NQ-open; "judge" in the result holds its numbers, "retrieval_supported" the score's verdict alone).
        The judge is the rule's model: llm when it is that model, else the engine's, else loaded once. ValueError
        when no rule ships for this engine's reranker and embedder."""
        from certrag.certify.conformal import CalibrationError, calibrated_scores

        rule = self.presence_rule if judge else None
        if judge and rule is None:
            raise ValueError("judge_support needs the answer-presence rule shipped with a packaged reranker; none "
                             f"fits this engine (reranker {self.reranker_identity()}, embedder {self.embedder_name})")
        cal = self.calibration
        out = None
        if cal is not None:
            try:
                scores = calibrated_scores(r.rerank_scores, r.dense_scores, cal.score_transform)
            except CalibrationError:
                scores = None
            if scores is not None:
                best = float(scores.max()) if len(scores) else None
                supported = cal.s_thres is None or (best is not None and best >= cal.s_thres)
                out = {"supported": bool(supported), "best_score": best, "threshold": cal.s_thres,
                       "alpha": cal.alpha, "calibration": cal.source or "this store"}
        if rule is None:
            return out
        try:
            scores = calibrated_scores(r.rerank_scores, r.dense_scores, rule.score_transform)
        except CalibrationError:
            return out
        if not len(scores):
            return out
        from certrag.certify.presence import log_odds

        best_i = int(np.argmax(scores))
        judge_llm = self._judge_model(rule, llm)
        t0 = time.perf_counter()
        said = float(log_odds(judge_llm, [(r.question, r.texts[best_i])])[0])
        judged_ms = (time.perf_counter() - t0) * 1e3
        value = rule.value(float(scores[best_i]), said)
        return {**(out or {"threshold": None, "alpha": None, "calibration": None}),
                "supported": value >= rule.threshold, "best_score": float(scores[best_i]),
                "retrieval_supported": None if out is None else out["supported"],
                "judge": {"model": rule.judge, "log_odds": said, "value": value, "threshold": rule.threshold,
                          "fitted_on": rule.fit.get("data", ""), "ms": judged_ms}}

    @property
    def presence_rule(self):
        """engine.presence when set, else the answer-presence rule shipped with this engine's packaged reranker
        (certrag.certify.presence), when it was fitted with exactly this embedder and reranker; else None."""
        if self.presence is not None:
            return self.presence
        reranker = self.reranker_identity()
        if reranker is None:
            return None
        return _shipped_presence_rule(self.embedder_name, reranker.get("name"), reranker.get("weights_sha256"))

    def _judge_model(self, rule, llm=None):
        """The LocalLLM that judges for rule: llm or the engine's model when it is the rule's, else one loaded
        once per engine family."""
        for candidate in (llm, self.stages.llm, self._default_llm):
            if getattr(candidate, "name", None) == rule.judge and getattr(candidate, "weights", None) == rule.weights:
                return candidate
        key = (rule.judge, rule.weights)
        with self._judge_lock:
            if key not in self._judges:
                from certrag.llm import LocalLLM
                from certrag.llm.models import MissingModel

                try:
                    self._judges[key] = LocalLLM(rule.judge, weights=rule.weights)
                except MissingModel as exc:  # an option this installation cannot serve: the caller's to drop
                    raise ValueError(f"judge_support needs the reader {rule.judge}: {exc}") from None
            return self._judges[key]

    def set_calibration(self, calibration) -> None:
        """Stores a calibration with the store (atomically), after checking it matches this engine's models."""
        from certrag.certify.conformal import CALIBRATION_FILE

        self._writable()
        calibration.check_identity(self.embedder_name, self.reranker_identity())
        with self._write_lock:
            calibration.save(self.path / CALIBRATION_FILE)
            self._calibration = calibration

    def calibrate(self, data: object, *, alpha: float = 0.1, holdout: float = 0.3, eval_data: object = None,
                  save: bool = True, progress: bool = True, **judge):
        """Conformal calibration of the retrieval scores (certrag.certify.calibration.calibrate) on data: a JSONL
        path, 'nq-open:calibration', or a list of items. Stored with the store unless save=False; returns the
        record."""
        from certrag.certify.calibration import calibrate

        if save:
            self._writable()
        record, _, _ = calibrate(self, data, alpha=alpha, holdout=holdout, eval_data=eval_data, progress=progress,
                                 **judge)
        if save:
            self.set_calibration(record)
        return record

    def certify(self, retrieval: Retrieval, *, force: bool = False):
        """Marks each candidate trusted or not under the stored calibration (certrag.certify.conformal.certify).
        applied is True when the diagnostics say the guarantee holds (or force): only then should the context
        shrink to the trusted candidates."""
        from certrag.certify.conformal import certify

        cal = self.calibration
        if cal is not None:
            cal.check_identity(self.embedder_name, self.reranker_identity())
        return certify(cal, retrieval, force=force, chunks=len(self), where=str(self.path),
                       reranker_backend=self.reranker_backend())

    @property
    def llm(self):
        """The stages' LLM, or the bundled default reader (loaded on first use) when the stages name none."""
        if self.stages.llm is not None:
            return self.stages.llm
        if self._default_llm is None:
            from certrag.llm import LocalLLM

            self._default_llm = LocalLLM()
        return self._default_llm

    @llm.setter
    def llm(self, value) -> None:
        """engine.llm = model: the same as building the engine with Stages(..., llm=model)."""
        self.stages = self.stages.replace(llm=value)

    def answer(self, question: str, strategy="plain", *, answer_options: AnswerOptions | None = None,
               llm=None, retrieval: Retrieval | None = None, on_text=None, cancelled=None, **fields) -> Answer:
        """Retrieves, then answers with a strategy: a name from certrag.strategies.STRATEGY_NAMES (plain,
        chain_of_note, self_rag, feedback = SAGE's loop around plain, feedback:<name> around another) or a
        strategy object such as SelfRag(delta=0.5) or Feedback(ChainOfNote()). The feedback loop re-selects from
        the same reranked candidates with min_k moved by the model's flag, so retrieval runs once.

        The request's options come as one AnswerOptions (answer_options=...), or as its fields by keyword (qtype,
        options -- the choices of a multiple-choice question --, prices, max_new_tokens, certify, force_certify,
        confidence); see certrag.answering.AnswerOptions.

        certify=True marks every candidate trusted or not under the store's conformal calibration and, when its
        diagnostics say the guarantee holds (or force_certify=True), sends the trusted candidates instead of the
        selector's cut (at most selection.max_k); with none trusted the answer is "unknown", counted as a rejection,
        and no LLM call is made. confidence=True fills Answer.p_correct, the probability that the answer contains a
        reference answer, from the classifier engine.factuality (by default the one shipped for the model:
        lookback ratios recorded while the local model writes, stacked with the mean log-probability, or the
        calibrated log-probability; its card says which). judge_support=True: Answer.support is decided by the
        answer-presence rule shipped with the reranker (a reader asked whether the best candidate states the answer;
        Engine.support), and with certify a question it judges not supported is answered "unknown" without an LLM
        call.

        llm: the model for this call only (default: engine.llm). on_text(piece): called with the text of every model
        call of this answer as it is decoded (Chain-of-Note's notes, then the answer; a remote model's text arrives
        whole); cancelled(): polled before every token, stops the call's decoding when true. retrieval: a Retrieval
        of this question already made (engine.retrieve), used instead of retrieving again."""
        from certrag.strategies import make_strategy

        if answer_options is not None and fields:
            raise ValueError("give the answer options either as answer_options=AnswerOptions(...) or as keywords, "
                             "not both")
        opts = answer_options if answer_options is not None else AnswerOptions(**fields)
        chosen = make_strategy(strategy)
        if opts.max_new_tokens is not None:
            chosen = chosen.with_max_new_tokens(opts.max_new_tokens)
        llm = model = self.llm if llm is None else llm
        if on_text is not None or cancelled is not None:
            from certrag.llm.calls import CallView

            llm = CallView(llm, on_text=on_text, cancelled=cancelled)
        classifier = self._factuality_for(llm) if opts.confidence else None
        t0 = time.perf_counter()
        if retrieval is not None and retrieval.question != question:
            raise ValueError("retrieval was made for another question")
        r = self.retrieve(question) if retrieval is None else retrieval
        retrieve_ms = (time.perf_counter() - t0) * 1e3 if retrieval is None else retrieval_ms(r)
        certification = None
        if opts.certify or opts.force_certify or opts.judge_support:
            r = self._scored_for_calibration(question, r)
        if opts.certify or opts.force_certify:
            certification = self.certify(r, force=opts.force_certify)
        relevance = None
        if opts.grounding and opts.qtype == "open":
            from certrag.grounding import default_relevance

            relevance = default_relevance()
        support = self.support(r, judge=opts.judge_support, llm=model)
        abstain = certification is not None and support is not None and "judge" in support \
            and not support["supported"]
        a = answer_from(question, r, chosen, llm, opts, selection=self.config.selection,
                        certification=certification, classifier=classifier, relevance=relevance,
                        retrieve_ms=retrieve_ms, reranker=self.reranker, abstain=abstain)
        return dataclasses.replace(a, support=support)

    def _scored_for_calibration(self, question: str, r: Retrieval) -> Retrieval:
        """r, or the question retrieved again with the reranker when the calibration is on reranker logits and the
        adaptive skip rule left r without them: certification must score every question the way the calibration
        did (the skip rule fires exactly on the questions whose dense ranking looks decisive)."""
        if not r.trace.get("rerank_skipped"):
            return r
        on_logits = [x.score_transform == "rerank logit" for x in (self.calibration, self.presence_rule) if x]
        if not any(on_logits):
            return r
        return self.retrieve(question, rerank=True, candidates=len(r.chunk_ids))

    def _factuality_for(self, llm):
        """The factuality classifier for llm: engine.factuality when set, else the one shipped for the model (per
        call: two requests on two models each get their own model's classifier)."""
        from certrag.protocols import records_lookback

        if not records_lookback(llm):
            raise ValueError("confidence needs a local model (certrag LocalLLM): it reads the model's attention and "
                             "token probabilities")
        if self.factuality is not None:
            return self.factuality
        from certrag.certify.factuality import FactualityClassifier

        return FactualityClassifier.for_model(llm.name)

    async def aretrieve(self, question: str, **kwargs) -> Retrieval:
        """retrieve() in a worker thread, so an event loop keeps serving while the models run."""
        import asyncio

        return await asyncio.to_thread(self.retrieve, question, **kwargs)

    async def aretrieve_batch(self, questions: Sequence[str], **kwargs) -> list[Retrieval]:
        """retrieve_batch() in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.retrieve_batch, questions, **kwargs)

    async def aanswer(self, question: str, strategy="plain", **kwargs) -> Answer:
        """answer() in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.answer, question, strategy, **kwargs)

    def retrieve(self, question: str, *, candidates: int | None = None, selector=None,
                 rerank: bool | str | None = None, where=None) -> Retrieval:
        """Embeds, searches, reranks and selects for one question (a non-empty string); see retrieve_batch."""
        if not isinstance(question, str):
            raise ValueError(f"question must be a string; got {type(question).__name__} (for several questions "
                             "use retrieve_batch)")
        if not question.strip():
            raise ValueError("question must be a non-empty string")
        check_text(question, "question")
        return self.retrieve_batch([question], candidates=candidates, selector=selector, rerank=rerank,
                                   where=where)[0]

    def retrieve_batch(self, questions: Sequence[str], *, candidates: int | None = None, selector=None,
                       rerank: bool | str | None = None, where=None) -> list[Retrieval]:
        """One Retrieval per question, embedded and searched as one batch.

        candidates overrides config.retrieval.candidates (N); selector overrides the configured selector; rerank=False
        skips the cross-encoder for this call (the dense scores then rank and feed the selector), True forces it,
        "adaptive" follows the reranker's skip rule. where={"key": value or [values]} keeps only chunks of documents
        whose metadata match (searching deeper until N match). Asking for more candidates than the store holds
        returns what it has.
        """
        if isinstance(questions, str):
            raise ValueError("questions must be a list of strings; for one question use retrieve")
        questions = check_questions(questions)
        return self._retriever.retrieve_batch(self._view, questions, candidates=candidates, selector=selector,
                                              rerank=rerank, where=where)


def calibration_summary(cal) -> dict | None:
    if cal is None:
        return None
    d = cal.diagnostics
    return {"alpha": cal.alpha, "s_thres": cal.s_thres, "n": cal.n, "holds": d.holds, "coverage": d.coverage,
            "m1": d.m1, "m2": d.m2, "created": cal.created, "source": cal.source or "this store"}


def describe_store(path: str | Path) -> dict:
    """What a store holds, from its manifest alone (no model, no index, no data file read): what `certrag info
    STORE` prints. Engine.info adds the encoders' backends and the index's own statistics."""
    from certrag.certify.conformal import CALIBRATION_FILE, Calibration, CalibrationError
    from certrag.rerank import PACKAGE_RERANKERS, identity_of

    path = Path(path)
    m = read_manifest(path)
    models = m.get("models", {})
    try:
        if (path / CALIBRATION_FILE).exists():
            cal = Calibration.load(path / CALIBRATION_FILE)
        else:
            folder = PACKAGE_RERANKERS.get(models.get("reranker"))
            cal = default_calibration(models.get("embedder"), identity_of(folder)) if folder else None
        calibration = calibration_summary(cal)
    except CalibrationError as exc:
        calibration = {"error": str(exc)}
    counts = m.get("counts", {})
    return {"path": str(path), "format_version": m.get("format_version"), "written": m.get("written"),
            "documents": counts.get("documents"), "chunks": counts.get("chunks"), "models": models,
            "config": m.get("config"), "index": m.get("index"), "calibration": calibration}


def default_calibration(embedder: str, reranker: dict | None):
    """The calibration shipped with a packaged reranker (certrag.train.default_calibration), when it was made with
    this embedder and exactly this reranker; else None."""
    if reranker is None:
        return None
    return _shipped_calibration(embedder, reranker.get("name"), reranker.get("weights_sha256"))


@functools.lru_cache(maxsize=8)
def _shipped_presence_rule(embedder: str, name: str | None, weights: str | None):
    from certrag.certify.presence import PresenceRule
    from certrag.rerank import PACKAGE_RERANKERS

    rule = PresenceRule.shipped(PACKAGE_RERANKERS.get(name))
    made_with = (rule.reranker or {}) if rule is not None else {}
    if rule is None or rule.embedder != embedder or made_with.get("name") != name \
            or made_with.get("weights_sha256") != weights:
        return None
    return rule


@functools.lru_cache(maxsize=8)
def _shipped_calibration(embedder: str, name: str | None, weights: str | None):
    from certrag.certify.conformal import DEFAULT_CALIBRATION_FILE as DEFAULT_FILE
    from certrag.certify.conformal import Calibration, CalibrationError
    from certrag.rerank import PACKAGE_RERANKERS

    folder = PACKAGE_RERANKERS.get(name)
    if folder is None or not (folder / DEFAULT_FILE).exists():
        return None
    try:
        cal = Calibration.load(folder / DEFAULT_FILE)
    except CalibrationError:
        return None
    made_with = cal.reranker or {}
    if cal.embedder != embedder or made_with.get("weights_sha256") != weights or made_with.get("name") != name:
        return None
    return cal


def retrieval_ms(r: Retrieval) -> float:
    """What a retrieval took, from its own trace (embed, search, rerank and select, per question)."""
    return float(sum(r.trace.get(k) or 0.0 for k in ("embed_ms", "search_ms", "rerank_ms", "select_ms")))


def _stages(config: EngineConfig, stages: Stages | None, embedder, reranker) -> Stages:
    """stages, or the config's defaults, with an embedder or reranker given by keyword in place of its own."""
    if stages is None:
        return Stages.default(config, embedder=embedder, reranker=reranker)
    if embedder is not None or reranker is not None:
        raise ValueError("give the models either as stages=Stages(...) or as embedder= / reranker=, not both")
    return stages
