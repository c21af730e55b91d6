"""Indexing as a Ray Data job: the documents are read by Ray (JSONL, folders of text, Parquet), segmented and
embedded by a pool of actors that each load the models once (map_batches), and the store is written once, by this
process, atomically, exactly as Engine.build writes it (certrag.ingest: the same chunks and vectors, the same chunk
ids in document order). A worker that dies is restarted and its batch retried by Ray; a job that fails for good
writes nothing (a new store's folder is removed; an existing store keeps its version).

    certrag index corpus.jsonl --store S --ray            # a local Ray cluster in this process
    certrag index corpus/ --store S --ray auto --workers 8  # the cluster this machine belongs to

Paths must be readable by every worker (a shared file system on a multi-node cluster), as for any Ray Data read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from certrag.config import EngineConfig
from certrag.documents import (
    Document, _read_text, document_files, document_from_line, document_from_row, load_documents,
)
from certrag.ingest import GROUP, Prepared

_COLUMNS = ("id", "text", "metadata")  # every source is normalised to these (metadata as a JSON string)
_LIGHT = {"num_cpus": 0}


def _rows(docs: list[Document]) -> dict:
    return {"id": np.array([d.id for d in docs], dtype=object),
            "text": np.array([d.text for d in docs], dtype=object),
            "metadata": np.array([json.dumps(d.metadata, ensure_ascii=False) for d in docs], dtype=object)}


def _jsonl_lines(where: str):
    def parse(batch: dict) -> dict:
        docs = [document_from_line(str(line), where) for line in batch["text"]]
        return _rows([d for d in docs if d is not None])
    return parse


def _parquet_rows(where: str):
    def parse(batch) -> dict:
        from certrag.documents import _without_nulls

        rows = batch.to_pylist()
        return _rows([document_from_row(_without_nulls(r), f"{where}: row") for r in rows])
    return parse


def _text_files(batch: dict) -> dict:
    docs = [Document(id=str(i), text=_read_text(Path(str(p))), metadata={"source": str(p)})
            for i, p in zip(batch["id"], batch["path"])]
    return _rows(docs)


def _source_datasets(source: object) -> list:
    """One Ray dataset per source, each of _COLUMNS, in the order load_documents would read them."""
    import ray.data

    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and len(source) < 4096
                                           and Path(source).expanduser().exists()):
        path = Path(source).expanduser()
        if path.is_dir():
            files = document_files(path)
            if not files:
                load_documents(path)  # the same error as a local build
            return [ds for f in files for ds in _file_dataset(f, path)]
        return _file_dataset(path, None)
    return [ray.data.from_items([{"id": d.id, "text": d.text,
                                  "metadata": json.dumps(d.metadata, ensure_ascii=False)}
                                 for d in load_documents(source)])]


def _file_dataset(path: Path, root: Path | None) -> list:
    import ray.data

    suffix = path.suffix.lower()
    # Reading and parsing take no CPU slot: the workers hold them all, and a read waiting for one would wait forever
    if suffix == ".jsonl":
        return [ray.data.read_text(str(path), ray_remote_args=_LIGHT)
                .map_batches(_jsonl_lines(str(path)), batch_format="numpy", **_LIGHT)]
    if suffix == ".parquet":
        return [ray.data.read_parquet(str(path), ray_remote_args=_LIGHT)
                .map_batches(_parquet_rows(str(path)), batch_format="pyarrow", **_LIGHT)]
    name = str(path.relative_to(root)) if root is not None else path.name
    return [ray.data.from_items([{"id": name, "path": str(path)}])
            .map_batches(_text_files, batch_format="numpy", **_LIGHT)]


class SegmentEmbedWorker:
    """A Ray Data actor: loads the chunker and the embedder once, then segments and embeds batches of documents
    (certrag.ingest.prepare). Its output row per document: id, text, metadata (JSON), chunks (JSON) and vectors
    (float32 bytes, row-major)."""

    def __init__(self, config: dict, threads: int = 1) -> None:
        import torch

        from certrag.engine import Engine
        from certrag.segment import make_chunker

        torch.set_num_threads(threads)
        cfg = EngineConfig.from_dict(config)
        self.embedder = Engine._default_embedder(cfg)
        self.chunker = make_chunker(cfg.chunker, cfg.segmenter, embedder=self.embedder)

    def __call__(self, batch: dict) -> dict:
        from certrag.ingest import prepare

        docs = [Document(id=str(i), text=str(t), metadata=json.loads(str(m)))
                for i, t, m in zip(batch["id"], batch["text"], batch["metadata"])]
        out = prepare(docs, self.chunker, self.embedder)
        return {**_rows([p.doc for p in out]),
                "chunks": np.array([json.dumps(p.chunks, ensure_ascii=False) for p in out], dtype=object),
                "vectors": np.array([np.ascontiguousarray(p.vectors, np.float32).tobytes() for p in out],
                                    dtype=object)}


def _prepared(ds, dim: int, progress: bool) -> Iterator[Prepared]:
    from tqdm.auto import tqdm

    with tqdm(desc="indexing on ray", unit="doc", disable=not progress) as bar:
        for batch in ds.iter_batches(batch_size=GROUP, batch_format="numpy"):
            for i, t, m, c, v in zip(batch["id"], batch["text"], batch["metadata"], batch["chunks"],
                                     batch["vectors"]):
                chunks = json.loads(str(c))
                vectors = np.frombuffer(bytes(v), dtype=np.float32).reshape(len(chunks), dim)
                yield Prepared(Document(id=str(i), text=str(t), metadata=json.loads(str(m))), chunks, vectors)
                bar.update(1)


def index_on_ray(documents: object, store: str | Path, config: EngineConfig | None = None, *,
                 address: str | None = None, workers: int = 2, threads_per_worker: int = 1,
                 batch_docs: int = GROUP, overwrite: bool = False, progress: bool = True):
    """Builds a new store at `store` (or adds to the one there) from documents -- paths (JSONL, Parquet, text files,
    folders of them) or anything load_documents takes -- segmenting and embedding on `workers` Ray actors of
    `threads_per_worker` torch threads, batch_docs documents per batch. Returns the open Engine; its last_report
    says what was indexed. address: a Ray cluster (None starts a local one in this process; "auto" joins this
    machine's). config applies to a new store only (an existing store keeps its own)."""
    from certrag.engine import Engine
    from certrag.scale import connect

    for name, value in (("workers", workers), ("threads_per_worker", threads_per_worker),
                        ("batch_docs", batch_docs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    store = Path(store)
    exists = (store / "CURRENT").exists()
    if exists and config is not None:
        raise ValueError("config applies to a new store only; the store at "
                         f"{store} keeps its own")
    sources = documents if isinstance(documents, (list, tuple)) and all(
        isinstance(s, (str, os.PathLike)) for s in documents) else [documents]
    connect(address)
    from ray.data import ActorPoolStrategy, DataContext

    DataContext.get_current().execution_options.preserve_order = True  # chunk ids follow the documents' order

    def run(engine) -> None:
        parts = [ds for s in sources for ds in _source_datasets(s)]
        ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        ds = ds.map_batches(SegmentEmbedWorker, batch_size=batch_docs, batch_format="numpy",
                            fn_constructor_kwargs={"config": engine.config.to_dict(), "threads": threads_per_worker},
                            compute=ActorPoolStrategy(size=workers), num_cpus=threads_per_worker)
        engine._ingest_prepared(_prepared(ds, engine._embedder.dim, progress))

    if exists:
        engine = Engine.open(store)
        try:
            with engine._write_lock:
                run(engine)
        except BaseException:
            engine.close()
            raise
        return engine
    return Engine._create(store, config, embedder=None, reranker=None, overwrite=overwrite, fill=run)
