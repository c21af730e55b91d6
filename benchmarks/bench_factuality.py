"""How well lookback ratios predict whether an answer is right: AUROC of the factuality classifier and baselines.

Data (certrag.train.factuality): the bundled reader answers NQ-open questions from 3 passages each (the gold passage for
half of them, MiniLM-nearest other NQ gold passages as distractors), recording lookback ratios; label = a gold answer
is contained in the normalised answer. Train: the NQ-open train split (the examples `certrag train-factuality`
saved); held-out dataset: the first --test-questions of the test split, answered here the same way.

Scores compared (Lookback Lens, Chuang et al. 2024, Table 1; the certification paper's chunk-wise variant):
logistic regression on chunk-wise features, on full-context features (one ratio per layer and head each), and two
baselines without training: the answer's mean token log-probability and the top reranker score of its passages.
AUROC cross-validated on train (5 folds, C chosen on the same folds: slightly optimistic) and on the held-out test
questions (fit on all of train).

    python benchmarks/bench_factuality.py --test-questions 200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-questions", type=int, default=400)
    p.add_argument("--test-questions", type=int, default=200)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(1)

    import hashlib

    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.train.factuality import auroc, collect, fit, load_examples, save_examples
    from certrag.home import certrag_home

    def examples(split: str, n: int, path: Path) -> dict:
        items = load_nq_open(split=split)[:n]
        meta = {"model": args.model, "split": split, "questions": len(items), "k": 3,
                "question_hash": hashlib.sha256("\n".join(it.question for it in items).encode()).hexdigest()[:16]}
        if path.exists():
            data, got = load_examples(path)
            if got == meta:
                return data
        from certrag.llm import LocalLLM
        from certrag.rerank import CrossEncoderReranker

        data = collect(LocalLLM(args.model), items, k=3, reranker=CrossEncoderReranker.default())
        save_examples(path, data, meta)
        return data

    train = examples("train", args.train_questions,
                     certrag_home() / f"factuality-train-{args.model}-{args.train_questions}-k3.safetensors")
    test = examples("test", args.test_questions,
                    _common.DATA_DIR / f"factuality-test-{args.model}-{args.test_questions}-k3.safetensors")

    def finite(d, key):
        return np.isfinite(d[key]).all(1) if d[key].ndim == 2 else np.isfinite(d[key])

    rows = []
    for kind in ("chunks", "full"):
        ktr, kte = finite(train, kind), finite(test, kind)
        n_feat = train[kind].shape[1]
        clf, cv = fit(train[kind][ktr], train["label"][ktr], model=args.model, kind=kind, layers=0, heads=0, card={})
        held = auroc(test["label"][kte], clf.predict_vectors(test[kind][kte]))
        rows.append({"what": "factuality_auroc", "score": f"logistic regression, {kind} lookback ratios",
                     "features": n_feat, "cv_auroc": clf.card["cv_auroc"], "heldout_auroc": held,
                     "C": clf.card["C"], "train_n": int(ktr.sum()), "test_n": int(kte.sum())})
    for key, name in (("mean_logprob", "mean token log-probability (baseline)"),
                      ("top_rerank", "top reranker score of the passages (baseline)")):
        rows.append({"what": "factuality_auroc", "score": name, "features": 1,
                     "cv_auroc": auroc(train["label"], train[key]), "heldout_auroc": auroc(test["label"], test[key]),
                     "C": None, "train_n": int(finite(train, key).sum()), "test_n": int(finite(test, key).sum())})
    for r in rows:
        print(r, file=sys.stderr)
    bal = {s: (float(d["label"].mean()), float(d["label"][d["with_gold"] == 1].mean()),
               float(d["label"][d["with_gold"] == 0].mean())) for s, d in (("train", train), ("test", test))}
    meta = _common.meta({"bench": "bench_factuality", "model": args.model, "train_questions": args.train_questions,
                         "test_questions": args.test_questions})
    best = max(rows, key=lambda r: r["heldout_auroc"])
    text = "\n".join([
        "### Factual confidence from lookback ratios (bench_factuality.py)\n",
        f"**Verdict:** on held-out test questions the best score is {best['score']} (AUROC "
        f"{best['heldout_auroc']:.3f}). Lookback Lens reports up to 0.82 (full context) and the certification paper "
        f"0.77 (chunk-wise) with 8B models; these are {args.model}'s.\n",
        f"Answers of {args.model} (greedy, at most 24 tokens) to NQ-open questions from 3 passages (gold included for "
        f"half). Supported (gold answer contained): train {bal['train'][0]:.2f} of answers "
        f"({bal['train'][1]:.2f} with the gold passage, {bal['train'][2]:.2f} without); test {bal['test'][0]:.2f} "
        f"({bal['test'][1]:.2f} / {bal['test'][2]:.2f}).\n",
        _common.markdown_table(["score", "features", "AUROC, 5-fold CV on train", "AUROC, held-out test", "C",
                                "train n", "test n"],
                               [[r["score"], r["features"], r["cv_auroc"], r["heldout_auroc"], r["C"], r["train_n"],
                                 r["test_n"]] for r in rows]),
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_factuality", rows, meta)
        _common.update_results_md("bench_factuality", text)


if __name__ == "__main__":
    main()
