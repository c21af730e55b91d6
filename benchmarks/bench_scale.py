"""The engine at scale: indexing throughput on >= 10 MB of text, and retrieve() latency on a >= 100k-chunk store.

Corpus: the Python 3.11 documentation (python3.11-doc, one document per page, paragraphs joined by blank lines) plus
the NQ-open gold passages and the Wikipedia leads (certrag.data.corpora): about 12.9 MB of text.

1. Indexing throughput, no embedding cache: the whole corpus through the default engine (SAGE segmentation, MiniLM,
   native HNSW, atomic write), and through the sentence-packing chunker at 256 tokens as the cheap baseline.
2. Latency: the same corpus chunked small (sentence packing at 32 tokens) into a store of >= 100k chunks; retrieve()
   (embed + search + rerank of 20 candidates + select) for NQ-open test questions at 1 and 16 concurrent callers, and
   the same without reranking to show where the time goes.

    python benchmarks/bench_scale.py                      # both parts
    python benchmarks/bench_scale.py --part latency       # reuse the 100k store built by an earlier run
    python benchmarks/bench_scale.py --ray                # Ray Data indexing, sharded search, Ray Serve
                                                          # (benchmarks/_scale_ray.py; --ray-parts to choose)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

PARTIAL = _common.DATA_DIR / "bench_scale_partial.json"


def scale_corpus():
    from certrag.documents import Document
    from certrag.data.corpora import retrieval_corpus
    from certrag.data.corpora import pydoc_documents

    docs = [Document(id=d.name, text="\n\n".join(d.paragraphs), metadata={"source": "pydoc"})
            for d in pydoc_documents()]
    return docs + retrieval_corpus()


def small_chunk_config():
    from certrag.config import EngineConfig, IndexConfig, RetrievalConfig
    from certrag.segment import SegmenterConfig

    return EngineConfig(chunker="fixed_sentence", segmenter=SegmenterConfig(min_tokens=8, max_tokens=32),
                        index=IndexConfig(ef_search=64), retrieval=RetrievalConfig(candidates=20))


def index_throughput(corpus, embedder, chunkers=("sage", "fixed_sentence")) -> list[dict]:
    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.engine import Engine

    mb = sum(len(d.text.encode()) for d in corpus) / 1e6
    rows = []
    configs = {"sage": ("sage (default)", EngineConfig(retrieval=RetrievalConfig(rerank=False))),
               "fixed_sentence": ("fixed_sentence 256", EngineConfig(chunker="fixed_sentence",
                                                                     retrieval=RetrievalConfig(rerank=False)))}
    for name, cfg in (configs[c] for c in chunkers):
        with tempfile.TemporaryDirectory(dir=_common.DATA_DIR) as tmp:
            t = time.perf_counter()
            with Engine.build(corpus, Path(tmp) / "s", cfg, embedder=embedder, progress=True) as e:
                n_chunks = len(e)
            dt = time.perf_counter() - t
        rows.append({"what": "indexing_throughput", "chunker": name, "documents": len(corpus), "mb": mb,
                     "chunks": n_chunks, "seconds": dt, "docs_per_s": len(corpus) / dt,
                     "chunks_per_s": n_chunks / dt, "mb_per_min": mb / dt * 60})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def latency(corpus, embedder, reranker, questions) -> tuple[list[dict], dict | None]:
    from certrag.engine import Engine
    from certrag.select import TopKSelector

    store = _common.DATA_DIR / "scale_store"
    config = small_chunk_config()
    engine = None
    if (store / "CURRENT").exists():
        engine = Engine.open(store, read_only=True, embedder=embedder, reranker=reranker)
        if engine.config != config or len(engine.documents) != len(corpus):
            engine.close()
            engine = None
    build = None
    if engine is None:  # building the store is itself an indexing-throughput measurement (>= 10 MB, no cache)
        t = time.perf_counter()
        engine = Engine.build(corpus, store, config, embedder=embedder, reranker=reranker, overwrite=True)
        dt = time.perf_counter() - t
        mb = sum(len(d.text.encode()) for d in corpus) / 1e6
        build = {"what": "indexing_throughput", "chunker": "fixed_sentence 32 (the latency store)",
                 "documents": len(corpus), "mb": mb, "chunks": len(engine), "seconds": dt,
                 "docs_per_s": len(corpus) / dt, "chunks_per_s": len(engine) / dt, "mb_per_min": mb / dt * 60}
        print(json.dumps(build), file=sys.stderr, flush=True)
    rows = []
    for rerank in (True, False):
        for q in questions[:3]:
            engine.retrieve(q, rerank=rerank)
        selector = None if rerank else TopKSelector(k=5)
        for callers in (1, 16):
            row = _common.concurrent_latency(lambda q: engine.retrieve(q, rerank=rerank, selector=selector),
                                             questions, callers)
            rows.append({"what": "retrieve_latency", "rerank": rerank, "chunks": len(engine), **row})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    engine.close()
    return rows, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "indexing", "latency"), default="all",
                   help="indexing: SAGE and sentence packing over the whole corpus; latency: build the 100k-chunk "
                        "store (timed too) and measure retrieve")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunkers", default="sage,fixed_sentence", help="the indexing part's chunkers")
    p.add_argument("--latency-queries", type=int, default=200)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--ray", action="store_true", help="the scale-out benchmarks instead (benchmarks/_scale_ray.py)")
    p.add_argument("--ray-parts", default="indexing,search,serving")
    args = p.parse_args()
    _common.pin_threads(args.threads)
    if args.ray:
        import _scale_ray
        from certrag.data.nq import load_nq_open

        _common.DATA_DIR.mkdir(parents=True, exist_ok=True)
        questions = [it.question for it in load_nq_open(split="test")]
        _scale_ray.run(scale_corpus(), questions, args.ray_parts.split(","), not args.no_write)
        return

    from certrag.embed import Embedder
    from certrag.data.nq import load_nq_open
    from certrag.rerank import CrossEncoderReranker

    _common.DATA_DIR.mkdir(parents=True, exist_ok=True)
    corpus = scale_corpus()
    partial = json.loads(PARTIAL.read_text()) if PARTIAL.exists() else {}
    embedder = Embedder()  # no cache: the real cost of embedding
    if args.part in ("all", "indexing"):
        partial["indexing"] = index_throughput(corpus, embedder, tuple(args.chunkers.split(",")))
        PARTIAL.write_text(json.dumps(partial))
    if args.part in ("all", "latency"):
        questions = [it.question for it in load_nq_open(split="test")][: args.latency_queries]
        partial["latency"], build = latency(corpus, embedder, CrossEncoderReranker.default(), questions)
        if build is not None:
            partial["latency_store_build"] = build
        PARTIAL.write_text(json.dumps(partial))
    if "latency" not in partial:
        print("partial results saved; run the latency part to write RESULTS.md", file=sys.stderr)
        return
    indexing = partial.get("indexing", []) + ([partial["latency_store_build"]] if "latency_store_build" in partial
                                              else [])

    mb = sum(len(d.text.encode()) for d in corpus) / 1e6
    meta = _common.meta({"bench": "bench_scale", "corpus_documents": len(corpus), "corpus_mb": mb,
                         "threads": args.threads})
    lat = partial["latency"]
    big = lat[0]["chunks"]
    text = "\n".join([
        "### The engine at scale (bench_scale.py)\n",
        f"Corpus: {len(corpus):,} documents, {mb:.1f} MB of text (Python 3.11 docs, NQ-open gold passages, Wikipedia "
        f"leads); {args.threads} torch thread(s).\n",
        "Indexing throughput with no embedding cache (segment + embed + index + atomic write)"
        + ("" if "indexing" in partial else "; the SAGE row of this corpus was not run here (`--part indexing`: "
           "bench_retrieval.py measures SAGE on a sample)")
        + (" (rows run with different thread counts: the latency store's build with one thread)"
           if "indexing" in partial and "latency_store_build" in partial else "") + ":\n",
        _common.markdown_table(["chunker", "documents", "MB", "chunks", "seconds", "docs/s", "chunks/s", "MB/min"],
                               [[x["chunker"], x["documents"], x["mb"], x["chunks"], x["seconds"], x["docs_per_s"],
                                 x["chunks_per_s"], x["mb_per_min"]] for x in indexing]),
        f"\nLatency of `retrieve` on a {big:,}-chunk store (sentence packing at 32 tokens), "
        f"{lat[0]['queries']} NQ-open test questions per row; with reranking of 20 candidates (the default) and "
        "without (embed + search + top-5):\n",
        _common.markdown_table(["rerank", "callers", "chunks", "p50 ms", "p90 ms", "p99 ms", "throughput q/s"],
                               [[x["rerank"], x["callers"], x["chunks"], x["p50_ms"], x["p90_ms"], x["p99_ms"],
                                 x["throughput_qps"]] for x in lat]),
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_scale", indexing + lat, meta)
        _common.update_results_md("bench_scale", text)


if __name__ == "__main__":
    main()
