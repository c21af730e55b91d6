"""The two encoders on this CPU: every backend tried, its speed and its quality, side by side on the same inputs.

Backends: torch float32 (the reference; "today" = float32 with the old padding of a call's pairs to its longest
one), torch bfloat16, certrag's int8 (per-row activation scales, batch-independent: certrag.quantize), torch's
dynamic int8 quantisation (one activation scale per batch: "int8-dynamic"), and ONNX Runtime float32 and int8 (dynamic quantisation of
the exported graph; the runtime that sentence-transformers' and fastembed's CPU paths use). All share the same
tokenizer and the same length-sorted batches, so the table compares the backends and nothing else.

Quality (deterministic; may run beside other work): reranker MRR@10 and R@1 over the 20 dense candidates of each
NQ-open test question in the benchmark store (bench_retrieval's, fixed candidate sets); embedder recall@5 with the
store's chunks and the questions embedded by each backend (exact search); SAGE segmentation boundary F1 on
bench_segmentation's held-out documents; the adaptive-reranking rule (certrag.train.skip_rule, fitted on train)
applied to the test split. Bounds (issue 16): MRR@10 and R@1 within 0.003 of float32, recall@5 within 0.003,
segmentation F1 within 0.005; adaptive MRR@10 drop <= 0.002.

Speed (run alone, pinned, warmed up, repeated, medians): reranking one question's 20 candidates; embedding
sentences in bulk and one question; retrieve() end to end on the 12.7k-chunk store for today's path, each
reduced-precision backend the CPU runs natively (the default marked) and the default with adaptive reranking;
indexing MB/min with SAGE on a sample of bench_scale's corpus, today's path against each of those backends.

A smaller reranker (--student DIR, e.g. one distilled by `certrag train-reranker --teacher certrag/reranker --layers
3`) gets its own rows: its MRR@10 and R@1 on the same candidates against the shipped reranker's float32 (same
bounds), its reranking latency and its `retrieve` path on each store.

    python benchmarks/bench_encoders.py --part quality        # ~40 min on 2 cores
    python benchmarks/bench_encoders.py --part speed          # ~15 min, alone
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ALL = ("float32", "bfloat16", "int8", "int8-dynamic", "onnx-float32", "onnx-int8")
PARTIAL = _common.DATA_DIR / "bench_encoders_partial.json"


# ------------------------------------------------------------------------------------------------ ONNX Runtime


def _onnx_session(kind: str, precision: str, threads: int):
    """An ONNX Runtime session for the reranker ("reranker") or the embedder ("embedder"), exported once from the
    bundled weights into benchmarks/data/onnx (and quantised for int8)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from certrag.embed import Embedder
    from certrag.rerank import CrossEncoderReranker

    out = _common.DATA_DIR / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"{kind}-float32.onnx"
    if not f32.exists():
        if kind == "reranker":
            model, output = CrossEncoderReranker(backend="float32").model, "logits"
        else:
            model, output = Embedder(backend="float32", memo_size=0).model, "last_hidden_state"

        class Wrapped(torch.nn.Module):  # positional inputs and one tensor out, as the exporter wants
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, input_ids, attention_mask, token_type_ids):
                return getattr(self.m(input_ids=input_ids, attention_mask=attention_mask,
                                      token_type_ids=token_type_ids), output)

        x = torch.ones((2, 16), dtype=torch.long)
        names = ["input_ids", "attention_mask", "token_type_ids"]
        tmp = f32.with_suffix(".tmp.onnx")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Wrapped().eval(), (x, x, torch.zeros_like(x)), str(tmp), input_names=names,
                              output_names=["out"], dynamic_axes={n: {0: "batch", 1: "seq"} for n in names},
                              dynamo=False, opset_version=17)
        tmp.replace(f32)
    path = f32
    if precision == "int8":
        path = out / f"{kind}-int8.onnx"
        if not path.exists():
            from onnxruntime.quantization import QuantType, quantize_dynamic

            tmp = path.with_suffix(".tmp.onnx")
            quantize_dynamic(str(f32), str(tmp), weight_type=QuantType.QInt8)
            tmp.replace(path)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    del np
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _torch_dynamic_int8(model):
    """torch's dynamic quantisation of every Linear (one activation scale per batch): the int8 path before
    certrag's per-row one, kept here for comparison."""
    import warnings

    import torch

    with warnings.catch_warnings():  # torch points users of eager quantisation at torchao; it still works
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8)


def make_reranker(backend: str, threads: int):
    """An object with cross_scores(questions, passages) and dense_weight, for any backend in ALL."""
    from certrag.rerank import CrossEncoderReranker

    if backend == "int8-dynamic":
        r = CrossEncoderReranker(backend="float32")
        r.model = _torch_dynamic_int8(r.model)
        return r
    if not backend.startswith("onnx-"):
        return CrossEncoderReranker(backend=backend)
    import numpy as np

    from certrag.backends import length_batches, padded

    base = CrossEncoderReranker(backend="float32")
    sess = _onnx_session("reranker", backend.split("-", 1)[1], threads)

    class OnnxReranker:
        dense_weight = base.dense_weight
        name = base.name

        def cross_scores(self, questions, passages, batch_size=8):
            enc = base._tokenizer.encode_batch(list(zip(questions, passages)))
            out = np.zeros(len(passages), np.float32)
            for rows in length_batches([len(e.ids) for e in enc], batch_size, base.pad_grid):
                out[rows] = sess.run(None, padded(enc, rows, 0, base.pad_grid))[0][:, 0]
            return out

    return OnnxReranker()


def make_embedder(backend: str, threads: int):
    """An Embedder (memo off) for any backend in ALL; the ONNX ones replace only the forward pass."""
    from certrag.embed import Embedder

    if backend == "int8-dynamic":
        e = Embedder(backend="float32", memo_size=0)
        e.model = _torch_dynamic_int8(e.model)
        return e
    if not backend.startswith("onnx-"):
        return Embedder(backend=backend, memo_size=0)
    import numpy as np

    from certrag.backends import length_batches, padded

    sess = _onnx_session("embedder", backend.split("-", 1)[1], threads)

    class OnnxEmbedder(Embedder):
        def _embed_uncached(self, texts):
            enc = self._tokenizer.encode_batch(texts)
            out = np.zeros((len(texts), self.dim), np.float32)
            for rows in length_batches([len(e.ids) for e in enc], self.batch_size, self.pad_grid):
                feed = padded(enc, rows, self._pad_id, self.pad_grid)
                feed["token_type_ids"][:] = 0
                hidden = sess.run(None, feed)[0]
                m = feed["attention_mask"][..., None].astype(np.float32)
                pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
                out[rows] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
            return out

    return OnnxEmbedder(backend="float32", memo_size=0)


# ------------------------------------------------------------------------------------------------------ quality


def _test_candidates(limit: int):
    """(questions, candidate texts, dense scores, gold position or -1) from the store's cached test retrievals."""
    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.rerank import CrossEncoderReranker

    from _nq import cached_embedder, cached_retrievals, nq_store

    reranker = CrossEncoderReranker.default("float32")
    engine, corpus = nq_store(cached_embedder(), reranker)
    gold_doc = {d.text: d.id for d in corpus}
    items = load_nq_open(split="test")
    # always the whole split, so that the cache bench_retrieval shares stays whole; then the first `limit`
    results = cached_retrievals(engine, reranker, [it.question for it in items], 20, "retrieval_candidates.json")
    if limit:
        items, results = items[:limit], results[:limit]
    cands = []
    for it, r in zip(items, results):
        hits = [i for i, d in enumerate(r.doc_ids) if d == gold_doc[it.gold_text]]
        # cached_retrievals keeps the reranked order: bring back the dense order the index returned
        order = np.argsort(-r.dense_scores, kind="stable")
        gold = int(np.flatnonzero(order == hits[0])[0]) if hits else -1
        cands.append((it.question, [r.texts[i] for i in order], r.dense_scores[order], gold))
    return engine, corpus, items, cands


def quality(backends: list[str], limit: int, threads: int, partial: dict, save: bool = True) -> dict:
    import numpy as np

    from certrag.segment import Segmenter
    from certrag.train.skip_rule import reciprocal_rank

    from _nq import cached_embedder
    from bench_segmentation import boundary_f1, held_out_docs, held_out_items

    engine, corpus, items, cands = _test_candidates(limit)
    store_texts = [c["text"] for c in engine._data.chunks]
    store_docs = np.array([c["doc_id"] for c in engine._data.chunks])
    gold_doc = {d.text: d.id for d in corpus}
    seg_items, _ = held_out_items(held_out_docs())
    rows = partial.setdefault("quality", {})
    for b in backends:
        if b in rows:
            print(f"{b}: kept from the partial run", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        rr = make_reranker(b, threads)
        rr_fused, rr_dense, gaps, top1 = [], [], [], []
        for q, texts, dense, gold in cands:
            fused = rr.cross_scores([q] * len(texts), texts) + rr.dense_weight * dense
            rr_fused.append(reciprocal_rank(fused, gold))
            rr_dense.append(reciprocal_rank(dense, gold))
            top1.append(gold >= 0 and int(np.argmax(fused)) == gold)
            gaps.append(float(dense[0] - dense[1]))
        emb = make_embedder(b, threads)
        if b == "float32":  # the embedding cache holds every chunk's float32 vector
            from certrag.embed import Embedder

            vectors = Embedder(backend="float32", memo_size=0, cache=cached_embedder().cache).embed(store_texts)
        else:
            vectors = emb.embed(store_texts)
        qv = emb.embed([it.question for it in items])
        top5 = np.argsort(-(qv @ vectors.T), axis=1)[:, :5]
        recall5 = float(np.mean([gold_doc[it.gold_text] in set(store_docs[t]) for it, t in zip(items, top5)]))
        seg = Segmenter(embedder=emb)
        _, _, f1 = boundary_f1(seg_items, seg.split_many([it[1] for it in seg_items]))
        rows[b] = {"backend": b, "questions": len(cands), "mrr10": float(np.mean(rr_fused)),
                   "r1": float(np.mean(top1)), "mrr10_dense": float(np.mean(rr_dense)), "recall5": recall5,
                   "segmentation_f1": f1, "rr": rr_fused, "rr_dense": rr_dense, "gaps": gaps,
                   "seconds": time.perf_counter() - t0, "measured": _common.meta()}
        print(f"{b}: MRR@10 {rows[b]['mrr10']:.4f} R@1 {rows[b]['r1']:.4f} recall@5 {recall5:.4f} "
              f"seg F1 {f1:.4f} ({rows[b]['seconds']:.0f} s)", file=sys.stderr)
        if save:
            _save(partial)
    engine.close()
    return rows


def student_quality(student: Path, backends: list[str], limit: int, partial: dict, save: bool = True) -> dict:
    """MRR@10 and R@1 of a smaller reranker over the same test candidates as the backends' rows."""
    import numpy as np

    from certrag.rerank import CrossEncoderReranker
    from certrag.train.skip_rule import reciprocal_rank

    engine, _, _, cands = _test_candidates(limit)
    engine.close()
    rows = partial.setdefault("student_quality", {})
    for b in backends:
        t0 = time.perf_counter()
        rr = CrossEncoderReranker(student, backend=b)
        fused = [rr.cross_scores([q] * len(texts), texts) + rr.dense_weight * dense for q, texts, dense, _ in cands]
        key = f"{rr.name} {b}"
        rows[key] = {"reranker": rr.name, "layers": rr.card.get("layers"), "dir": str(student), "backend": b,
                     "questions": len(cands),
                     "mrr10": float(np.mean([reciprocal_rank(f, g) for f, (*_, g) in zip(fused, cands)])),
                     "r1": float(np.mean([g >= 0 and int(np.argmax(f)) == g for f, (*_, g) in zip(fused, cands)])),
                     "seconds": time.perf_counter() - t0, "measured": _common.meta()}
        print(f"{key}: MRR@10 {rows[key]['mrr10']:.4f} R@1 {rows[key]['r1']:.4f}", file=sys.stderr)
        if save:
            _save(partial)
    return rows


# -------------------------------------------------------------------------------------------------------- speed


def speed(backends: list[str], threads: int, n_questions: int, index_docs: int, scale_store: bool,
          student: Path | None = None) -> dict:
    import numpy as np

    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.data.nq import load_nq_open
    from certrag.embed import Embedder
    from certrag.engine import Engine
    from certrag.rerank import CrossEncoderReranker

    from _nq import nq_store
    from bench_scale import scale_corpus

    engine, _ = nq_store(Embedder(backend="float32", memo_size=0), CrossEncoderReranker(backend="float32"))
    view = engine._view
    questions = [it.question for it in load_nq_open(split="test")][:n_questions]
    found = view.index.search(engine.embedder.embed(questions), k=20, ef=128)
    cand = [[view.chunks[view.position[int(c)]]["text"] for c in ids] for ids in found.ids]
    short = [[t[:160] for t in c] for c in cand]  # ~32-token chunks, as in bench_scale's 125k-chunk store

    out = {"rerank": [], "embed": [], "retrieve": [], "indexing": []}
    rerankers = {b: make_reranker(b, threads) for b in backends}
    rerankers[f"default, {SERIAL}"] = _serial(CrossEncoderReranker())
    if student is not None:
        small = CrossEncoderReranker(student)
        rerankers[f"{small.backend.backend}, {small.name} ({small.card.get('layers')} layers)"] = small
    rerankers["float32, padded (today)"] = CrossEncoderReranker(backend="float32", batch_size=32, pad_grid=0)
    names = list(rerankers)
    for label, pool in (("12.7k store passages", cand), ("32-token chunks", short)):
        times = {n: [] for n in names}
        for n in names:  # warm-up
            rerankers[n].cross_scores([questions[0]] * 20, pool[0])
        for q, texts in zip(questions, pool):  # interleaved, so drift hits every backend alike
            for n in names:
                t = time.perf_counter()
                rerankers[n].cross_scores([q] * len(texts), texts, batch_size=32 if "today" in n else 8)
                times[n].append(time.perf_counter() - t)
        base = float(np.median(times["float32, padded (today)"]))
        for n in names:
            med = float(np.median(times[n]))
            out["rerank"].append({"backend": n, "candidates": label, "p50_ms": med * 1e3, "speedup": base / med})
            print(f"rerank {label} {n}: {med * 1e3:.1f} ms ({base / med:.2f}x)", file=sys.stderr)

    sentences = [s for c in cand[:40] for s in c[0].split(". ")][:2000]
    embedders = {b: make_embedder(b, threads) for b in backends}
    embedders[f"default, {SERIAL}"] = _serial(make_embedder("auto", threads))
    bulk = {n: [] for n in embedders}
    single = {n: [] for n in embedders}
    for n, e in embedders.items():
        e.embed(sentences[:64])
    for rep in range(3):
        for n, e in embedders.items():
            t = time.perf_counter()
            e._embed_uncached(sentences)
            bulk[n].append(time.perf_counter() - t)
    for q in questions[:60]:
        for n, e in embedders.items():
            t = time.perf_counter()
            e._embed_uncached([q])
            single[n].append(time.perf_counter() - t)
    for n in embedders:
        out["embed"].append({"backend": n, "sentences_per_s": len(sentences) / float(np.median(bulk[n])),
                             "question_ms": float(np.median(single[n])) * 1e3,
                             "speedup_bulk": float(np.median(bulk["float32"]) / np.median(bulk[n]))})
        print(f"embed {n}: {out['embed'][-1]}", file=sys.stderr)

    # retrieve() end to end: the engine's Retriever over the store view, as engine.retrieve runs
    out["retrieve"] += compare_paths(engine, questions, "NQ store", student)
    engine.close()
    if scale_store:
        from bench_scale import small_chunk_config

        store = _common.DATA_DIR / "scale_store"
        corpus = scale_corpus()
        big = None
        if (store / "CURRENT").exists():
            big = Engine.open(store, read_only=True, embedder=Embedder(memo_size=0))
            if big.config.replace(encoder_backend="auto") != small_chunk_config() or \
                    len(big.documents) != len(corpus):
                big.close()
                big = None
        if big is None:
            print("building bench_scale's store of short chunks (once)", file=sys.stderr)
            big = Engine.build(corpus, store, small_chunk_config(), embedder=Embedder(), overwrite=True)
        out["retrieve"] += compare_paths(big, questions, "bench_scale store (32-token chunks)", student)
        big.close()

    # indexing with SAGE on an evenly spaced sample of bench_scale's corpus, no embedding cache
    import tempfile

    corpus = scale_corpus()
    sample = corpus[:: max(1, len(corpus) // index_docs)][:index_docs]
    mb = sum(len(d.text.encode()) for d in sample) / 1e6
    from certrag.segment import Segmenter

    class OneAtATime:
        """The segmenter as it was: split() per document, so each document's sentences are one embed call."""

        name = "sage"

        def __init__(self, embedder):
            self._seg = Segmenter(embedder=embedder)

        def split(self, text):
            return self._seg.split(text)

    paths = {"today: float32, one document at a time, no memo": "float32"}
    paths.update({f"{_label(b)}, batched, each text once": b for b in _native_backends()})
    paths[f"default, batched, each text once, {SERIAL}"] = "auto"
    for name, backend in paths.items():
        today = name.startswith("today")
        emb = Embedder(backend="float32", memo_size=0, pad_grid=0) if today else Embedder(backend=backend)
        if SERIAL in name:
            _serial(emb)
        config = EngineConfig(encoder_backend=emb.backend.requested, retrieval=RetrievalConfig(rerank=False))
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            with Engine.build(sample[:1], Path(tmp) / "s", config, embedder=emb, progress=False) as e:
                if today:
                    e._chunker = OneAtATime(emb)
                e.add(sample[1:], progress=False)
                chunks = len(e)
            dt = time.perf_counter() - t
        out["indexing"].append({"path": name, "documents": len(sample), "mb": mb, "chunks": chunks, "seconds": dt,
                                "mb_per_min": mb / dt * 60})
        print(f"indexing {name}: {mb / dt * 60:.3f} MB/min", file=sys.stderr)
    return out


def _native_backends() -> list[str]:
    """The reduced-precision backends this CPU runs natively (bfloat16, int8), in that order."""
    from certrag.backends import resolve

    return [b for b in ("bfloat16", "int8") if resolve(b).backend == b]


SERIAL = "one pass after another on all threads (session 9)"


def _serial(model):
    """model with its call's batches run one after another on all torch threads, as before backends.passes."""
    model.max_passes = 1
    return model


def _label(backend: str) -> str:
    from certrag.backends import resolve

    return f"{backend} (the default: auto)" if resolve("auto").backend == backend else backend


def _retrieve_backends() -> dict[str, tuple[str, str]]:
    """path label -> (embedder backend, reranker backend): each native reduced-precision backend for both encoders,
    and the default embedder with the reranker in int8 (the one encoder int8 holds every bound for)."""
    from certrag.backends import resolve

    default = resolve("auto").backend
    native = _native_backends()
    paths = {f"{_label(b)}, length-sorted batches on a padding grid": (b, b) for b in native}
    if "int8" in native and default != "int8":
        paths[f"embedder {default} + reranker int8 (a scale per row), length-sorted batches"] = (default, "int8")
    return paths


def compare_paths(engine, questions: list[str], label: str, student: Path | None = None) -> list[dict]:
    """retrieve() p50 for today's path (float32, a call's pairs padded to the longest), the default path, the
    default with adaptive reranking and, given one, the default with a smaller reranker, interleaved question by
    question on one store."""
    import numpy as np

    from certrag.config import RetrievalConfig
    from certrag.embed import Embedder
    from certrag.rerank import CrossEncoderReranker
    from certrag.retrieval import Retriever

    view, cfg = engine._view, engine.config
    cand = cfg.retrieval.candidates
    paths = {
        "today: float32, pairs padded to the longest": Retriever(
            Embedder(backend="float32", memo_size=0, pad_grid=0),
            CrossEncoderReranker(backend="float32", pad_grid=0),
            cfg.replace(encoder_backend="float32", retrieval=RetrievalConfig(candidates=cand, rerank_batch=32))),
    }
    for name, (emb, rr) in _retrieve_backends().items():  # the native backends and the mixed pair
        paths[name] = Retriever(Embedder(backend=emb, memo_size=0), CrossEncoderReranker(backend=rr),
                                cfg.replace(retrieval=RetrievalConfig(candidates=cand)))
    paths[f"default, {SERIAL}"] = Retriever(_serial(Embedder(memo_size=0)), _serial(CrossEncoderReranker()),
                                            cfg.replace(retrieval=RetrievalConfig(candidates=cand)))
    if CrossEncoderReranker().skip_rule:
        paths["default + adaptive reranking"] = Retriever(
            Embedder(memo_size=0), CrossEncoderReranker(),
            cfg.replace(retrieval=RetrievalConfig(candidates=cand, adaptive_rerank=True)))
    if student is not None:
        small = CrossEncoderReranker(student)
        paths[f"default, reranker {small.name} ({small.card.get('layers')} layers)"] = Retriever(
            Embedder(memo_size=0), small, cfg.replace(retrieval=RetrievalConfig(candidates=cand)))
    lat = {n: [] for n in paths}
    stage_ms = {n: {k: [] for k in ("embed_ms", "search_ms", "rerank_ms", "select_ms")} for n in paths}
    skipped = {n: 0 for n in paths}
    for n, r in paths.items():
        r.retrieve_batch(view, [questions[0]])
    for q in questions:
        for n, r in paths.items():
            t = time.perf_counter()
            got = r.retrieve_batch(view, [q])[0]
            lat[n].append(time.perf_counter() - t)
            skipped[n] += bool(got.trace.get("rerank_skipped"))
            for k in stage_ms[n]:
                stage_ms[n][k].append(got.trace[k])
    base = float(np.median(lat[next(iter(paths))]))
    rows = []
    for n in paths:
        med = float(np.median(lat[n]))
        rows.append({"store": label, "path": n, "chunks": len(engine), "queries": len(questions),
                     "p50_ms": med * 1e3, "p90_ms": float(np.percentile(lat[n], 90)) * 1e3, "ratio": med / base,
                     "skip_rate": skipped[n] / len(questions),
                     "stage_mean_ms": {k: float(np.mean(v)) for k, v in stage_ms[n].items()}})
        print(f"retrieve {label} {n}: {med * 1e3:.1f} ms ({med / base:.2f} of today)", file=sys.stderr)
    return rows


def _save(partial: dict) -> None:
    PARTIAL.parent.mkdir(parents=True, exist_ok=True)
    tmp = PARTIAL.with_suffix(".tmp")
    tmp.write_text(json.dumps(partial))
    tmp.replace(PARTIAL)


def report(partial: dict, meta: dict) -> str:
    import numpy as np

    from certrag.backends import resolve
    from certrag.rerank import CrossEncoderReranker
    from certrag.train.skip_rule import apply

    q = partial.get("quality", {})
    s = partial.get("speed", {})
    ref = q.get("float32")
    lines = ["### The encoders: backends, adaptive reranking, indexing without repeated work (bench_encoders.py)\n"]
    if ref:
        rows = []
        for b, r in q.items():
            ok = (abs(r["mrr10"] - ref["mrr10"]) <= 0.003 and abs(r["r1"] - ref["r1"]) <= 0.003
                  and abs(r["recall5"] - ref["recall5"]) <= 0.003
                  and abs(r["segmentation_f1"] - ref["segmentation_f1"]) <= 0.005)
            sp = next((x for x in s.get("rerank", []) if x["backend"] == b and x["candidates"].startswith("12.7k")),
                      None)
            es = next((x for x in s.get("embed", []) if x["backend"] == b), None)
            rows.append([b, r["mrr10"], r["mrr10"] - ref["mrr10"], r["r1"], r["r1"] - ref["r1"], r["recall5"],
                         r["recall5"] - ref["recall5"], r["segmentation_f1"],
                         r["segmentation_f1"] - ref["segmentation_f1"], "yes" if ok else "NO",
                         sp["p50_ms"] if sp else "-", sp["speedup"] if sp else "-",
                         es["sentences_per_s"] if es else "-", es["question_ms"] if es else "-"])
        lines += [f"Quality on the NQ-open test split ({ref['questions']} questions, 20 dense candidates each, the "
                  "same candidate sets for every backend) and speed (rerank: one question's 20 candidates, median; "
                  "speed-up against today's float32 path with a call's pairs padded to the longest; embed: 2,000 "
                  "sentences in bulk, and one question):\n",
                  _common.markdown_table(["backend", "MRR@10", "diff", "R@1", "diff", "recall@5", "diff", "seg F1",
                                          "diff", "within bounds", "rerank ms", "rerank speed-up", "embed sent/s",
                                          "embed question ms"], rows)]
        rule = CrossEncoderReranker(backend="float32").skip_rule
        default = resolve("auto").backend
        if rule and default in q:
            d = q[default]
            a = apply(np.array(d["gaps"]), np.array(d["rr_dense"]), np.array(d["rr"]), rule["threshold"])
            lines.append(
                f"\nAdaptive reranking ({default}; rule fitted on the train split: skip when cos_1 - cos_2 >= "
                f"{rule['threshold']:.4f}, train skip rate {rule['train_skip_rate']:.1%}): on test it skips "
                f"{a['skip_rate']:.1%} of questions at MRR@10 {a['mrr_adaptive']:.4f} against {a['mrr_reranked']:.4f} "
                f"always reranked (drop {a['mrr_drop']:+.4f}; bound 0.002: "
                f"{'met' if a['mrr_drop'] <= 0.002 else 'NOT met'}); the bi-encoder alone: {a['mrr_dense']:.4f}.")
    if ref and partial.get("student_quality"):
        rows = [[k, r["layers"], r["mrr10"], r["mrr10"] - ref["mrr10"], r["r1"], r["r1"] - ref["r1"],
                 "yes" if r["mrr10"] - ref["mrr10"] >= -0.003 and r["r1"] - ref["r1"] >= -0.003 else "NO"]
                for k, r in partial["student_quality"].items()]
        lines += ["\nA smaller reranker (distilled from the shipped one; `certrag train-reranker --teacher`), on the "
                  "same candidates, against the shipped reranker in float32 (bounds: MRR@10 and R@1 at most 0.003 "
                  "below; another model may also rank better):\n",
                  _common.markdown_table(["reranker and backend", "layers", "MRR@10", "diff", "R@1", "diff",
                                          "within bounds"], rows)]
    if s.get("rerank"):
        lines += ["\nReranking latency per backend, one question's 20 candidates (median):\n",
                  _common.markdown_table(["backend", "candidates", "p50 ms", "speed-up vs today"],
                                         [[x["backend"], x["candidates"], x["p50_ms"], x["speedup"]]
                                          for x in s["rerank"]])]
    if s.get("embed"):
        lines += ["\nEmbedding speed per backend (2,000 sentences in bulk, median of 3; one question, median):\n",
                  _common.markdown_table(["backend", "sentences/s", "question ms", "bulk speed-up vs float32"],
                                         [[x["backend"], x["sentences_per_s"], x["question_ms"], x["speedup_bulk"]]
                                          for x in s["embed"]])]
    if s.get("retrieve"):
        lines += [f"\n`retrieve` end to end ({s['retrieve'][0]['queries']} NQ-open test questions, one caller, the "
                  "paths interleaved question by question; ratio against today's path on the same store):\n",
                  _common.markdown_table(["store", "chunks", "path", "p50 ms", "p90 ms", "p50 / today",
                                          "rerank skipped"],
                                         [[x.get("store", "NQ store"), x["chunks"], x["path"], x["p50_ms"],
                                           x["p90_ms"], x["ratio"], x["skip_rate"]] for x in s["retrieve"]]),
                  "\n![retrieve time by stage](results/retrieve_stages.png)\n"]
    if s.get("indexing"):
        base = s["indexing"][0]["mb_per_min"]
        lines += [f"\nIndexing with SAGE, no embedding cache, {s['indexing'][0]['documents']} documents evenly "
                  f"sampled from bench_scale's corpus ({s['indexing'][0]['mb']:.2f} MB):\n",
                  _common.markdown_table(["path", "chunks", "seconds", "MB/min", "x today"],
                                         [[x["path"], x["chunks"], x["seconds"], x["mb_per_min"],
                                           x["mb_per_min"] / base] for x in s["indexing"]])]
    lines.append(_common.footer(meta))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("quality", "speed", "report"), required=True)
    p.add_argument("--backends", default=",".join(ALL))
    p.add_argument("--questions", type=int, default=0, help="test questions for quality (0 = all)")
    p.add_argument("--speed-questions", type=int, default=100)
    p.add_argument("--index-docs", type=int, default=600)
    p.add_argument("--scale-store", action="store_true",
                   help="also compare retrieve() on bench_scale's >= 100k-chunk store (built once if missing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--student", type=Path, default=None,
                   help="a smaller reranker folder to measure beside the shipped one (quality: float32 and the "
                        "native default backend; speed: its rerank and retrieve rows)")
    p.add_argument("--fresh", action="store_true", help="forget the partial results of earlier runs")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(args.threads)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(ALL)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(ALL)}")
    partial = {} if args.fresh or not PARTIAL.exists() else json.loads(PARTIAL.read_text())
    if args.student is not None and not (args.student / "config.json").exists():
        p.error(f"--student: no reranker at {args.student}")
    if args.part == "quality":
        quality(backends, args.questions, args.threads, partial, save=not args.no_write)
        if args.student is not None:
            from certrag.backends import resolve

            student_quality(args.student, sorted({"float32", resolve("auto").backend}), args.questions, partial,
                            save=not args.no_write)
        partial.setdefault("meta", {})["quality"] = _common.meta()
    elif args.part == "speed":
        partial["speed"] = speed(backends, args.threads, args.speed_questions, args.index_docs, args.scale_store,
                                 args.student)
        partial.setdefault("meta", {})["speed"] = _common.meta()
    if not args.no_write:
        _save(partial)
    metas = partial.get("meta", {})
    meta = metas.get("speed") or metas.get("quality") or _common.meta()
    text = report(partial, meta)
    if "quality" in metas and "speed" in metas:
        runs: dict[tuple, list[str]] = {}  # each quality row says which run measured it (runs keep earlier rows)
        for b, row in [*partial.get("quality", {}).items(), *partial.get("student_quality", {}).items()]:
            m = row.get("measured", metas["quality"])
            runs.setdefault((m["commit"], m["date"], m["command"]), []).append(b)
        text = text.replace(_common.footer(meta), "") + (
            "\nQuality: " + "; ".join(f"{', '.join(bs)}: commit {c}, {d}, `{cmd}`" for (c, d, cmd), bs in runs.items())
            + f". Speed: commit {metas['speed']['commit']}, {metas['speed']['date']}, "
            f"`{metas['speed']['command']}` (alone). Machine: {meta['machine']['cpu']}, "
            f"{meta['machine']['cores']} cores.\n")
    print(text)
    if not args.no_write:
        _common.write_rows("bench_encoders", [partial], meta)
        _common.update_results_md("bench_encoders", text)
        import plots

        plots.draw(plots.stages)


if __name__ == "__main__":
    main()
