"""Indexing as a Ray Data job: the documents are read by Ray (JSONL, folders of text, Parquet), segmented and
embedded by a pool of actors that each load the models once (map_batches), and the store is written once, by this
process, atomically, exactly as Engine.build writes it (certrag.ingest: the same chunks and vectors, the same chunk
ids in document order). A worker that dies is restarted and its batch retried by Ray; a job that fails for good
writes nothing (a new store's folder is removed; an existing store keeps its version).

    certrag index corpus.jsonl --store S --ray            # a local Ray cluster in this process
    certrag index corpus/ --store S --ray auto --workers 8  # the cluster this machine belongs to

Paths must be readable by every worker (a shared file system on a multi-node cluster), as for any Ray Data read.
Ray reads one file per task: a corpus in many files is read in parallel, one large file by one task.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from certrag.config import EngineConfig
from certrag.documents import Document, document_files, existing_path, load_documents
from certrag.ingest import GROUP, Prepared


def _rows(docs: list[Document], source: int = 0, file: int = 0) -> dict:
    """The columns of documents, with their place in the corpus (source, file, row): Ray may hand batches back in
    any order, and chunk ids are given in the corpus's order."""
    return {"source": np.full(len(docs), source, np.int64), "file": np.full(len(docs), file, np.int64),
            "row": np.arange(len(docs), dtype=np.int64),
            "id": np.array([d.id for d in docs], dtype=object),
            "text": np.array([d.text for d in docs], dtype=object),
            "metadata": np.array([json.dumps(d.metadata, ensure_ascii=False) for d in docs], dtype=object)}


def _read_files(batch: dict) -> dict:
    """The documents of each file (JSONL, Parquet, text), exactly as a local build reads it."""
    from certrag.documents import read_path

    (path,), (root,), (source,), (file,) = batch["path"], batch["root"], batch["source"], batch["file"]
    return _rows(read_path(Path(str(path)), Path(str(root)) if str(root) else None), int(source), int(file))


def _source_dataset(source: object, number: int):
    """A Ray dataset of _rows' columns (metadata as a JSON string) for one source: a path (a file or a folder: one
    read task per file, reading as load_documents does, so ids and metadata are the same) or documents in memory."""
    import ray.data

    path = existing_path(source)
    if path is not None:
        if path.is_dir():
            files, root = document_files(path), str(path)
            if not files:
                load_documents(path)  # the same error as a local build
        else:
            files, root = [path], ""
        # Reading takes no CPU slot: the workers hold them all, and a read waiting for one would wait forever
        items = [{"path": str(f), "root": root, "source": number, "file": i} for i, f in enumerate(files)]
        return ray.data.from_items(items).map_batches(_read_files, batch_size=1, batch_format="numpy", num_cpus=0)
    rows = _rows(load_documents(source), number)
    return ray.data.from_items([dict(zip(rows, values)) for values in zip(*(v.tolist() for v in rows.values()))])


class SegmentEmbedWorker:
    """A Ray Data actor: loads the chunker and the embedder once, then segments and embeds batches of documents
    (certrag.ingest.prepare). Its output row per document: id, text, metadata (JSON), chunks (JSON) and vectors
    (float32 bytes, row-major)."""

    def __init__(self, config: dict, threads: int = 1) -> None:
        import torch

        from certrag.segment import make_chunker
        from certrag.stages import default_embedder

        torch.set_num_threads(threads)
        cfg = EngineConfig.from_dict(config)
        self.embedder = default_embedder(cfg)
        self.chunker = make_chunker(cfg.chunker, cfg.segmenter, embedder=self.embedder)

    def __call__(self, batch: dict) -> dict:
        from certrag.ingest import prepare

        docs = [Document(id=str(i), text=str(t), metadata=json.loads(str(m)))
                for i, t, m in zip(batch["id"], batch["text"], batch["metadata"])]
        out = prepare(docs, self.chunker, self.embedder)
        return {**_rows([p.doc for p in out]), **{k: batch[k] for k in ("source", "file", "row")},
                "chunks": np.array([json.dumps(p.chunks, ensure_ascii=False) for p in out], dtype=object),
                "vectors": np.array([np.ascontiguousarray(p.vectors, np.float32).tobytes() for p in out],
                                    dtype=object)}


def _prepared(ds, dim: int, progress: bool) -> Iterator[Prepared]:
    """The workers' documents in the corpus's order. They are all held until the last has come -- the store is
    written once, at the end, with every vector in memory, as a local build does."""
    from tqdm.auto import tqdm

    done = []
    with tqdm(desc="indexing on ray", unit="doc", disable=not progress) as bar:
        for batch in ds.iter_batches(batch_size=GROUP, batch_format="numpy"):
            for at in range(len(batch["id"])):
                chunks = json.loads(str(batch["chunks"][at]))
                vectors = np.frombuffer(bytes(batch["vectors"][at]), dtype=np.float32).reshape(len(chunks), dim)
                doc = Document(id=str(batch["id"][at]), text=str(batch["text"][at]),
                               metadata=json.loads(str(batch["metadata"][at])))
                key = (int(batch["source"][at]), int(batch["file"][at]), int(batch["row"][at]))
                done.append((key, Prepared(doc, chunks, vectors)))
            bar.update(len(batch["id"]))
    done.sort(key=lambda kv: kv[0])
    return (p for _, p in done)


def index_on_ray(documents: object, store: str | Path, config: EngineConfig | None = None, *,
                 address: str | None = None, workers: int = 2, threads_per_worker: int = 1,
                 batch_docs: int = GROUP, overwrite: bool = False, force: bool = False, progress: bool = True):
    """Builds a new store at `store` (or adds to the one there) from documents -- paths (JSONL, Parquet, text files,
    folders of them) or anything load_documents takes -- segmenting and embedding on `workers` Ray actors of
    `threads_per_worker` torch threads, batch_docs documents per batch. Returns the open Engine; its build_report
    says what was indexed. address: a Ray cluster (None starts a local one in this process; "auto" joins this
    machine's). config applies to a new store only (an existing store keeps its own); force as in Engine.build."""
    from certrag.engine import Engine
    from certrag.scale.cluster import connect

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
    from ray.data import ActorPoolStrategy

    def run(engine):
        parts = [_source_dataset(s, i) for i, s in enumerate(sources)]
        ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        ds = ds.map_batches(SegmentEmbedWorker, batch_size=batch_docs, batch_format="numpy",
                            fn_constructor_kwargs={"config": engine.config.to_dict(), "threads": threads_per_worker},
                            compute=ActorPoolStrategy(size=workers), num_cpus=threads_per_worker)
        return engine.add_prepared(_prepared(ds, engine.embedder.dim, progress))

    if exists:
        engine = Engine.open(store)
        try:
            engine.build_report = run(engine)
        except BaseException:
            engine.close()
            raise
        return engine
    return Engine.build_from(run, store, config, overwrite=overwrite, force=force)
