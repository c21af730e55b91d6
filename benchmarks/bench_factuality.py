"""How well lookback ratios predict whether an answer is right: AUROC of the factuality classifier and baselines.

Data (certrag.train.factuality), two kinds of answers of the bundled reader, recording lookback ratios; label = a gold
answer is contained in the normalised answer:
- "protocol": from 3 passages each (the gold passage for half of them, MiniLM-nearest other NQ gold passages as
  distractors);
- "engine": from the passages the engine itself retrieves and selects for the question (store of
  bench_retrieval.py), the answers the classifier meets at run time.
Train: both kinds on the first --train-questions of the NQ-open train split; held out: both kinds on the first
--test-questions of the test split, reported separately.

Scores compared (Lookback Lens, Chuang et al. 2024, Table 1; the certification paper's chunk-wise variant):
logistic regression on chunk-wise features, on full-context features (one ratio per layer and head each), on
chunk-wise features plus the mean log-probability (combined: one feature among hundreds, shrunk with them), the
stacked form of the same (each block model's out-of-fold score and the mean log-probability joined by a second,
two-feature regression: certrag.train.factuality.fit_stacked), and two baselines without training: the answer's mean
token log-probability and the best *fused* reranker score of its passages (cross-encoder + dense term: the score
the engine ranks by). AUROC cross-validated on train (5 folds, C chosen on the same folds: slightly optimistic) and on
the held-out test questions (fit on all of train).

The four sets of answers (train / test x protocol / engine) are collected by --workers processes, one core each,
and cached (train sets under CERTRAG_HOME, test sets in benchmarks/data), so a rerun only refits and reports.

    python benchmarks/bench_factuality.py --test-questions 200
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _points(label, score) -> dict:
    """The held-out (label, score) pairs a ROC curve is drawn from (benchmarks/plots.py), finite scores only."""
    import numpy as np

    label, score = np.asarray(label), np.asarray(score, dtype=np.float64)
    keep = np.isfinite(score)
    return {"label": label[keep].astype(int).tolist(), "score": [round(float(v), 6) for v in score[keep]]}


def _shares(parts: list[tuple], workers: int) -> list[list[tuple]]:
    """The sets (split, n, kind, where) each worker collects: the costliest first, each to the least loaded worker.
    An engine answer costs about twice a protocol one (its passages are the retrieved ones, longer: measured 10
    against 3-5 s per answer on one core), so round-robin gave one worker every engine set."""
    def cost(part):
        return part[1] * (2 if part[2] == "engine" else 1)

    load, out = [0] * workers, [[] for _ in range(workers)]
    for part in sorted(parts, key=cost, reverse=True):
        i = load.index(min(load))
        out[i].append(part)
        load[i] += cost(part)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-questions", type=int, default=400)
    p.add_argument("--test-questions", type=int, default=200)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--workers", type=int, default=2,
                   help="processes collecting the four sets of answers (one torch thread and one core each)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers must be at least 1")
    _common.pin_threads(1, offset=args.worker or 0)

    import hashlib

    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.home import certrag_home
    from certrag.train.factuality import (auroc, collect, collect_engine, combined_features, fit, fit_stacked,
                                          load_examples, save_examples)

    state = {}

    def llm():
        if "llm" not in state:
            from certrag.llm import LocalLLM

            state["llm"] = LocalLLM(args.model)
        return state["llm"]

    def examples(split: str, n: int, kind: str, where: Path) -> dict:
        items = load_nq_open(split=split)[:n]
        meta = {"model": args.model, "split": split, "questions": len(items), "k": 3, "top_rerank": "fused",
                "kind": kind, "question_hash": hashlib.sha256("\n".join(it.question for it in items).encode()
                                                              ).hexdigest()[:16]}
        path = where / f"factuality-{kind}-{split}-{args.model}-{n}.safetensors"
        if path.exists():
            data, got = load_examples(path)
            if got == meta:
                return data
        from certrag.rerank import CrossEncoderReranker

        if kind == "protocol":
            data = collect(llm(), items, k=3, reranker=CrossEncoderReranker.default())
        else:
            from _nq import cached_embedder, nq_store

            engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
            data = collect_engine(engine, llm(), items)
        save_examples(path, data, meta)
        return data

    wanted = [(split, n, kind, certrag_home() if split == "train" else _common.DATA_DIR)
              for split, n in (("train", args.train_questions), ("test", args.test_questions))
              for kind in ("protocol", "engine")]
    if args.worker is not None:  # collect this worker's share of the sets (each cached as it is done) and stop
        for part in _shares(wanted, args.workers)[args.worker]:
            examples(*part)
        return
    if args.workers > 1:  # the sets are independent: collect them in parallel, then read them from the cache
        forwarded = ["--train-questions", str(args.train_questions), "--test-questions", str(args.test_questions),
                     "--model", args.model, "--workers", str(args.workers)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), *forwarded])
                 for i in range(min(args.workers, len(wanted)))]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker failed with exit code {proc.returncode}")
    parts = {(split, kind): examples(split, n, kind, where) for split, n, kind, where in wanted}

    def joined(split):
        a, b = parts[(split, "protocol")], parts[(split, "engine")]
        return {k: np.concatenate([a[k], b[k]]) for k in a if isinstance(a[k], np.ndarray)}

    train = joined("train")
    feats = {"chunks": lambda d: d["chunks"], "full": lambda d: d["full"],
             "combined": lambda d: combined_features(d, "chunks")}
    names = {"chunks": "logistic regression, chunk-wise lookback ratios",
             "full": "logistic regression, full-context lookback ratios",
             "combined": "logistic regression, chunk-wise ratios + mean log-probability"}
    rows = []
    for kind, feat in feats.items():
        x = feat(train)
        keep = np.isfinite(x).all(1)
        clf, _ = fit(x[keep], train["label"][keep], model=args.model, kind=kind, layers=0, heads=0, card={})
        row = {"what": "factuality_auroc", "score": names[kind], "features": x.shape[1],
               "cv_auroc": clf.card["cv_auroc"], "C": clf.card["C"], "train_n": int(keep.sum())}
        for test_kind in ("protocol", "engine"):
            d = parts[("test", test_kind)]
            xt = feat(d)
            kt = np.isfinite(xt).all(1)
            pred = clf.predict_vectors(xt[kt])
            row[f"heldout_{test_kind}"] = auroc(d["label"][kt], pred)
            row[f"test_n_{test_kind}"] = int(kt.sum())
            row[f"heldout_{test_kind}_points"] = _points(d["label"][kt], pred)
        rows.append(row)
    for kind in ("chunks", "full"):  # the block's score and the log-probability joined by a second regression
        x, lp = train[kind], train["mean_logprob"]
        keep = np.isfinite(x).all(1) & np.isfinite(lp)
        st = fit_stacked(x[keep], lp[keep], train["label"][keep], model=args.model, kind=kind, layers=0, heads=0,
                         card={})
        row = {"what": "factuality_auroc", "score": f"stacked: {names[kind].split(', ')[1]} model, then its score + "
               "mean log-probability", "features": x.shape[1] + 1, "cv_auroc": st.cv_auroc,
               "C": st.block.card["C"], "train_n": int(keep.sum())}
        for test_kind in ("protocol", "engine"):
            d = parts[("test", test_kind)]
            kt = np.isfinite(d[kind]).all(1) & np.isfinite(d["mean_logprob"])
            pred = st.predict_vectors(d[kind][kt], d["mean_logprob"][kt])
            row[f"heldout_{test_kind}"] = auroc(d["label"][kt], pred)
            row[f"test_n_{test_kind}"] = int(kt.sum())
            row[f"heldout_{test_kind}_points"] = _points(d["label"][kt], pred)
        rows.append(row)
    for key, name in (("mean_logprob", "mean token log-probability (baseline)"),
                      ("top_rerank", "best fused reranker score of the passages (baseline)")):
        row = {"what": "factuality_auroc", "score": name, "features": 1, "cv_auroc": auroc(train["label"], train[key]),
               "C": None, "train_n": int(np.isfinite(train[key]).sum())}
        for test_kind in ("protocol", "engine"):
            d = parts[("test", test_kind)]
            row[f"heldout_{test_kind}"] = auroc(d["label"], d[key])
            row[f"test_n_{test_kind}"] = int(np.isfinite(d[key]).sum())
            row[f"heldout_{test_kind}_points"] = _points(d["label"], d[key])
        rows.append(row)
    for r in rows:
        print({k: v for k, v in r.items() if not k.endswith("_points")}, file=sys.stderr)
    bal = {f"{s} {k}": (float(d["label"].mean()), float(d["label"][d["with_gold"] == 1].mean()),
                        float(d["label"][d["with_gold"] == 0].mean())) for (s, k), d in parts.items()}
    meta = _common.meta({"bench": "bench_factuality", "model": args.model, "train_questions": args.train_questions,
                         "test_questions": args.test_questions})
    best = max(rows, key=lambda r: r["heldout_engine"])
    logprob = next(r for r in rows if r["features"] == 1 and "log-probability" in r["score"])
    text = "\n".join([
        "### Factual confidence from lookback ratios (bench_factuality.py)\n",
        f"**Verdict:** on the engine's own answers to held-out test questions the best score is {best['score']} "
        f"(AUROC {best['heldout_engine']:.3f}; the log-probability baseline {logprob['heldout_engine']:.3f}). "
        "Lookback Lens reports up to 0.82 (full context) and the certification paper 0.77 (chunk-wise) with 8B "
        f"models; these are {args.model}'s.\n",
        f"Answers of {args.model} (greedy, at most 24 tokens) to NQ-open questions; supported = gold answer "
        "contained. Share supported (all / with the gold passage among the passages / without): " + "; ".join(
            f"{name} {v[0]:.2f} / {v[1]:.2f} / {v[2]:.2f}" for name, v in bal.items()) + ". Classifiers are "
        "trained on train protocol + train engine answers.\n",
        _common.markdown_table(["score", "features", "AUROC, 5-fold CV on train", "AUROC, held-out protocol",
                                "AUROC, held-out engine", "C", "train n", "test n (protocol / engine)"],
                               [[r["score"], r["features"], r["cv_auroc"], r["heldout_protocol"],
                                 r["heldout_engine"], r["C"], r["train_n"],
                                 f"{r['test_n_protocol']} / {r['test_n_engine']}"] for r in rows]),
        "\n![ROC curves on held-out answers](results/factuality_roc.png)\n" if not args.no_write else "",
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_factuality", rows, meta)
        import plots

        plots.draw(plots.roc)
        _common.update_results_md("bench_factuality", text)


if __name__ == "__main__":
    main()
