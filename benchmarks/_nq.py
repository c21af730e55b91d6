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
    from certrag.engine import Engine
    from certrag.eval.corpus import retrieval_corpus

    corpus = retrieval_corpus()
    config = nq_config()
    store = _common.DATA_DIR / "nq_store"
    if (store / "CURRENT").exists():
        # Read-only: several benchmark workers may hold it at once.
        engine = Engine.open(store, read_only=True, embedder=embedder, reranker=reranker)
        if engine.config == config and len(engine.documents) == len(corpus):
            return engine, corpus
        engine.close()
    return Engine.build(corpus, store, config, embedder=embedder, reranker=reranker, overwrite=True), corpus


def cached_embedder():
    from certrag.embed import Embedder, EmbeddingCache
    from certrag.segment.train import cache_dir

    return Embedder(cache=EmbeddingCache(cache_dir() / "embeddings-all-MiniLM-L6-v2.safetensors"))
