"""The NQ-open retrieval store shared by bench_retrieval.py and bench_qa.py (built once into benchmarks/data)."""

from __future__ import annotations

import _common


def nq_config():
    from certrag.config import EngineConfig, IndexConfig, RetrievalConfig
    from certrag.segment import SegmenterConfig

    return EngineConfig(chunker="fixed_sentence", segmenter=SegmenterConfig(min_tokens=1, max_tokens=256),
                        index=IndexConfig(ef_search=128), retrieval=RetrievalConfig(candidates=20))


def nq_store(embedder, reranker):
    """Opens (or builds) the store of NQ-open gold passages + Wikipedia leads, chunked one passage per chunk."""
    import fcntl

    store = _common.DATA_DIR / "nq_store"
    store.parent.mkdir(parents=True, exist_ok=True)
    # Shards of one benchmark start together: the first builds the store, the others wait for it and open it.
    with open(store.parent / "nq_store.build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _open_or_build(store, embedder, reranker)


def _open_or_build(store, embedder, reranker):
    from certrag.engine import Engine
    from certrag.data.corpora import retrieval_corpus

    corpus = retrieval_corpus()
    config = nq_config()
    if (store / "CURRENT").exists():
        # Read-only: several benchmark workers may hold it at once.
        engine = Engine.open(store, read_only=True, embedder=embedder, reranker=reranker)
        # what the store holds depends on these fields only (retrieval and selection settings are per call)
        built = ("chunker", "segmenter", "embedder", "index")
        if all(getattr(engine.config, f) == getattr(config, f) for f in built) and \
                len(engine.documents) == len(corpus):
            # the per-call settings are today's, not the ones saved when the store was built (a store built before
            # the selection default changed would otherwise keep the old one)
            return engine.with_settings(retrieval=config.retrieval, selection=config.selection), corpus
        engine.close()
    return Engine.build(corpus, store, config, embedder=embedder, reranker=reranker, overwrite=True), corpus


def cached_embedder(backend: str = "auto"):
    from certrag.embed import Embedder, EmbeddingCache
    from certrag.home import certrag_home

    return Embedder(cache=EmbeddingCache(certrag_home() / "embeddings-all-MiniLM-L6-v2.safetensors"), backend=backend)


def cached_retrievals(engine, reranker, questions: list[str], candidates: int, name: str) -> list:
    """engine.retrieve_batch for every question keeping all `candidates` (reranked), saved under benchmarks/data/<name>
    and reused while the questions, candidate count, reranker and store size are unchanged."""
    import json
    import sys
    import time

    import numpy as np

    from certrag.engine import Retrieval
    from certrag.select import TopKSelector

    key = {"questions": list(questions), "candidates": candidates, "reranker": reranker.card.get("seconds"),
           "chunks": len(engine)}
    backend = getattr(getattr(reranker, "backend", None), "backend", "float32")
    if backend != "float32":  # float32 retrievals keep the keys they were saved under
        key["backend"] = backend
        name = name.replace(".json", f"-{backend}.json")
    saved = _common.DATA_DIR / name
    if saved.exists():
        blob = json.loads(saved.read_text())
        if blob["key"] == key:
            return [Retrieval(question=r["q"], chunk_ids=np.array(r["ids"], dtype=np.int64), doc_ids=tuple(r["docs"]),
                              texts=tuple(engine.chunk(c)["text"] for c in r["ids"]),
                              dense_scores=np.array(r["dense"], dtype=np.float32),
                              rerank_scores=np.array(r["rerank"], dtype=np.float32), selected=len(r["ids"]))
                    for r in blob["results"]]
    t0 = time.perf_counter()
    results = engine.retrieve_batch(list(questions), candidates=candidates, selector=TopKSelector(k=candidates))
    print(f"retrieved {len(questions)} questions in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(saved.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "results": [
        {"q": r.question, "ids": r.chunk_ids.tolist(), "docs": list(r.doc_ids), "dense": r.dense_scores.tolist(),
         "rerank": r.rerank_scores.tolist()} for r in results]}))
    tmp.replace(saved)
    return results
