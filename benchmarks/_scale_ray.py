"""bench_scale.py --ray: certrag past one machine, measured on this one (issue 18).

1. Indexing throughput on >= 10 MB of the scale corpus (sentence packing at 256 tokens, no reranker): the local
   path with one torch thread, and index_on_ray with 1 and 2 workers of one thread each, on a local Ray cluster
   (num_cpus = 2). Targets: 2 workers >= 1.7x one worker; Ray's overhead at one worker <= 10% of the local path.
   Every build is checked to give the local build's chunks.
2. Sharded search on bench_scale's >= 100k-chunk store: the unsharded index against 2 and 4 shards (built from
   the same vectors, routed by document id), at the same ef; recall@10 against exact search, queries per second
   one query at a time (one thread), and the 2 shards as Ray actors (the fan-out a query pays).
3. Serving: /v1/retrieve on Ray Serve with 1 and 2 Encoders replicas against the single-process server, 16 clients
   in a closed loop on the NQ store.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import _common


def corpus_of_at_least(corpus, mb: float):
    out, size = [], 0
    for d in corpus:
        out.append(d)
        size += len(d.text.encode())
        if size >= mb * 1e6:
            break
    return out, size / 1e6


def indexing(corpus, log) -> list[dict]:
    import ray
    import torch

    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.engine import Engine
    from certrag.scale import index_on_ray

    docs, mb = corpus_of_at_least(corpus, 10.0)
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(rerank=False))
    rows, reference = [], None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, workers in (("local, 1 thread", 0), ("ray, 1 worker x 1 thread", 1),
                              ("ray, 2 workers x 1 thread", 2)):
            with tempfile.TemporaryDirectory(dir=_common.DATA_DIR) as tmp:
                t = time.perf_counter()
                if workers == 0:
                    torch.set_num_threads(1)
                    engine = Engine.build(docs, Path(tmp) / "s", config, progress=True)
                else:
                    engine = index_on_ray(docs, Path(tmp) / "s", config, workers=workers, batch_docs=64)
                dt = time.perf_counter() - t
                with engine:
                    texts = [c["text"] for c in engine._data.chunks]
                    if reference is None:
                        reference = texts
                    same = texts == reference
                    n = len(engine)
            rows.append({"what": "indexing_throughput", "path": name, "workers": workers, "documents": len(docs),
                         "mb": mb, "chunks": n, "seconds": dt, "mb_per_min": mb / dt * 60,
                         "same_chunks_as_local": same})
            log(rows[-1])
    finally:
        ray.shutdown()
    return rows


def sharded_search(questions, log) -> list[dict]:
    import ray

    from certrag.embed import Embedder
    from certrag.engine import Engine
    from certrag.shards import RayShardedIndex, ShardedIndex

    store = _common.DATA_DIR / "scale_store"
    if not (store / "CURRENT").exists():
        raise SystemExit("run `python benchmarks/bench_scale.py --part latency` first: it builds the 100k store")
    with Engine.open(store, read_only=True, verify=False) as engine:
        data = engine._data
        one = data.index
        vectors, ids = data.vectors, data.ids
        doc_of = [c["doc_id"] for c in data.chunks]
        ef = max(engine.config.index.ef_search, 10)
    queries = Embedder().embed(questions)
    k = 10
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :k]
    exact_ids = ids[exact]
    indexes = {1: one}
    for n in (2, 4):
        t = time.perf_counter()
        sharded = ShardedIndex.empty(n, one.dim, one.metric, one.M, one.ef_construction)
        sharded.add(vectors, ids, doc_of)
        log({"built": n, "seconds": time.perf_counter() - t})
        indexes[n] = sharded
    rows = []

    def measure(name, index, shards):
        for q in queries[:20]:
            index.search(q[None, :], k, ef)
        found, times = [], []
        for q in queries:
            t = time.perf_counter()
            r = index.search(q[None, :], k, ef, 1) if not isinstance(index, RayShardedIndex) else \
                index.search(q[None, :], k, ef)
            times.append(time.perf_counter() - t)
            found.append(r.ids[0])
        recall = float(np.mean([len(set(f) & set(e)) / k for f, e in zip(found, exact_ids)]))
        stats = index.stats()
        per = stats.get("per_shard")
        rows.append({"what": "sharded_search", "index": name, "shards": shards, "chunks": int(len(index)),
                     "ef": ef, "k": k, "queries": len(queries), "recall_at_10": recall,
                     "qps": len(times) / sum(times), **_common.percentiles_ms(times),
                     "memory_mb": stats.get("memory_bytes", 0) / 1e6,
                     "largest_shard": max(p["live"] for p in per) if per else int(len(index))})
        log(rows[-1])

    for n, index in indexes.items():
        measure("one HnswIndex" if n == 1 else f"ShardedIndex, {n} threads", index, n)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(dir=_common.DATA_DIR) as tmp:
            paths = []
            for i, shard in enumerate(indexes[2].shards):
                paths.append(Path(tmp) / f"shard{i}.hnsw")
                shard.save(paths[-1])
            actors = RayShardedIndex(paths)
            measure("2 Ray shard actors", actors, 2)
            actors.close()
    finally:
        ray.shutdown()
    return rows


def serving(questions, log) -> list[dict]:
    import bench_serve

    store = _common.DATA_DIR / "nq_store"
    if not (store / "CURRENT").exists():
        raise SystemExit("run `python benchmarks/bench_retrieval.py` first: it builds the NQ store")
    payloads = [{"question": q} for q in questions]
    rows = []
    for name, extra in (("single process (2 torch threads)", []),
                        ("ray serve, 1 Encoders replica x 1 thread", ["--ray"]),
                        ("ray serve, 1 Encoders replica x 2 threads", ["--ray", "--replica-threads", "2"]),
                        ("ray serve, 2 Encoders replicas x 1 thread", ["--ray", "--retrieval-replicas", "2"])):
        proc, port = bench_serve.start("served", store, extra=extra + ["--encoder-depth", "256"])
        try:
            bench_serve.load(port, "/v1/retrieve", payloads[:32], 16)  # warm up
            out = bench_serve.load(port, "/v1/retrieve", payloads, 16)
        finally:
            bench_serve.stop(proc)
        rows.append({"what": "serving", "server": name, **{k: v for k, v in out.items() if k != "_bodies"}})
        log(rows[-1])
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    idx = [r for r in rows if r["what"] == "indexing_throughput"]
    search = [r for r in rows if r["what"] == "sharded_search"]
    serve = [r for r in rows if r["what"] == "serving"]
    parts = ["### Beyond one machine: Ray Data indexing, sharded search, Ray Serve (bench_scale.py --ray)\n"]
    if idx:
        local = next(r for r in idx if r["workers"] == 0)
        one = next(r for r in idx if r["workers"] == 1)
        two = next(r for r in idx if r["workers"] == 2)
        parts += [f"Indexing {idx[0]['documents']:,} documents ({idx[0]['mb']:.1f} MB) with sentence packing at 256 "
                  "tokens, a local Ray cluster (num_cpus=2), one torch thread per worker:\n",
                  _common.markdown_table(["path", "chunks", "seconds", "MB/min", "same chunks as local"],
                                         [[r["path"], r["chunks"], r["seconds"], r["mb_per_min"],
                                           r["same_chunks_as_local"]] for r in idx]),
                  f"\n2 workers / 1 worker: **{one['seconds'] / two['seconds']:.2f}x** (target >= 1.7x); Ray's "
                  f"overhead at 1 worker: **{(one['seconds'] / local['seconds'] - 1) * 100:+.1f}%** of the local "
                  "path (target <= 10%).\n"]
    if search:
        parts += [f"\nSharded search on the {search[0]['chunks']:,}-chunk store, {search[0]['queries']} NQ-open test "
                  f"questions one at a time, ef={search[0]['ef']}, recall@10 against exact search:\n",
                  _common.markdown_table(["index", "shards", "recall@10", "q/s", "p50 ms", "p99 ms", "memory MB",
                                          "largest shard"],
                                         [[r["index"], r["shards"], r["recall_at_10"], r["qps"], r["p50_ms"],
                                           r["p99_ms"], r["memory_mb"], r["largest_shard"]] for r in search])]
    if serve:
        base = serve[0]["throughput_rps"]
        by = {r["server"]: r["throughput_rps"] for r in serve}
        one = next((v for k, v in by.items() if "1 Encoders replica x 1" in k), None)
        two = next((v for k, v in by.items() if "2 Encoders replicas" in k), None)
        parts += ["\n/v1/retrieve (embed, search, rerank 20, select) on the NQ store, 16 clients in a closed loop; "
                  "the single-process server's torch threads are the process's two, a replica's are its own:\n",
                  _common.markdown_table(["server", "requests", "q/s", "vs single process", "p50 ms", "p99 ms",
                                          "statuses"],
                                         [[r["server"], r["requests"], r["throughput_rps"],
                                           r["throughput_rps"] / base, r["p50_ms"], r["p99_ms"],
                                           json.dumps(r["statuses"])] for r in serve])]
        if one and two:
            parts.append(f"\n2 Encoders replicas / 1 (one thread each): **{two / one:.2f}x**; against the "
                         f"single-process server on the same two cores: {two / base:.2f}x.\n")
    if meta.get("note"):
        parts.append("\n" + meta["note"] + "\n")
    parts.append(_common.footer(meta))
    return "\n".join(parts)


def run(corpus, questions, parts: list[str], write: bool) -> None:
    def log(row):
        print(json.dumps(row), file=sys.stderr, flush=True)

    partial_path = _common.DATA_DIR / "bench_scale_ray_partial.json"
    partial = json.loads(partial_path.read_text()) if partial_path.exists() else {}
    if "indexing" in parts:
        partial["indexing"] = indexing(corpus, log)
        partial_path.write_text(json.dumps(partial))
    if "search" in parts:
        partial["search"] = sharded_search(questions[:500], log)
        partial_path.write_text(json.dumps(partial))
    if "serving" in parts:
        partial["serving"] = serving(questions[:200], log)
        partial_path.write_text(json.dumps(partial))
    rows = partial.get("indexing", []) + partial.get("search", []) + partial.get("serving", [])
    meta = _common.meta({"bench": "bench_scale --ray", "parts": parts})
    text = markdown(rows, meta)
    print(text)
    if write:
        _common.write_rows("bench_scale_ray", rows, meta)
        _common.update_results_md("bench_scale_ray", text)
