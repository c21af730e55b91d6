"""How well lookback ratios predict whether an answer is right: AUROC of the factuality classifier and baselines.

Data (certrag.train.factuality), two kinds of answers of the bundled reader, recording lookback ratios; label = a gold
answer is contained in the normalised answer:
- "protocol": from 3 passages each (the gold passage for half of them, MiniLM-nearest other NQ gold passages as
  distractors);
- "engine": from the passages the engine itself retrieves and selects for the question (store of
  bench_retrieval.py), the answers the classifier meets at run time.
Train: both kinds on the first --train-questions of the NQ-open train split; held out: both kinds on the first
--test-questions of the test split, reported separately.

Scores compared (Lookback Lens, Chuang et al. 2024, Table 1; the certification paper's chunk-wise variant): logistic
regression on chunk-wise features, on full-context features (one ratio per layer and head each), on chunk-wise
features plus the mean log-probability (combined: one feature among hundreds, shrunk with them), the stacked form of
the same (each block model's out-of-fold score and the mean log-probability joined by a second, two-feature
regression: certrag.train.factuality.fit_stacked), each block stacked with all the free signals (the answer's mean,
minimum and first token log-probability and its passages' best fused reranker score:
certrag.certify.factuality.answer_signals), a logistic regression on the free signals alone, and baselines without
training: the answer's mean, minimum and first token log-probability and the best *fused* reranker score of its
passages (cross-encoder + dense term: the score the engine ranks by) and the share of the answer's words found in
one of its passages (certrag.certify.factuality.answer_support). AUROC cross-validated on train (5 folds, C chosen on
the same folds: slightly optimistic), over all of train and over its engine answers alone, and on the held-out test
questions (fit on all of train). The classifier to ship is the candidate with the best cross-validated AUROC on the
train *engine* answers (certrag.train.factuality.choose with judge): those are the answers it scores at run time.

The four sets of answers (train / test x protocol / engine) are collected by --workers processes, one core each,
and cached (train sets under CERTRAG_HOME, test sets in benchmarks/data), so a rerun only refits and reports.

    python benchmarks/bench_factuality.py                      # about 75 min on two cores
    python benchmarks/bench_factuality.py --train-questions 400 --test-questions 200  # about 25 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _points(label, score) -> dict:
    """The held-out (label, score) pairs a ROC curve is drawn from (benchmarks/plots.py), finite scores only."""
    import numpy as np

    label, score = np.asarray(label), np.asarray(score, dtype=np.float64)
    keep = np.isfinite(score)
    return {"label": label[keep].astype(int).tolist(), "score": [round(float(v), 6) for v in score[keep]]}


def auroc_gain(label, a, b, reps: int = 2000, seed: int = 0) -> dict:
    """AUROC(a) - AUROC(b) over the answers both score (finite), with a 95% paired bootstrap interval (the same
    resampled answers for both scores; resamples with one class only are skipped)."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    label, a, b = np.asarray(label), np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    label, a, b = label[keep], a[keep], b[keep]
    if len(np.unique(label)) < 2:
        return {"gain": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": int(keep.sum())}
    rng = np.random.default_rng(seed)
    gains = []
    for _ in range(reps):
        i = rng.integers(0, len(label), len(label))
        if label[i].min() != label[i].max():
            gains.append(roc_auc_score(label[i], a[i]) - roc_auc_score(label[i], b[i]))
    return {"gain": float(roc_auc_score(label, a) - roc_auc_score(label, b)),
            "lo": float(np.quantile(gains, 0.025)), "hi": float(np.quantile(gains, 0.975)), "n": int(keep.sum())}


def wiki_items(n: int, seed: int = 20261203) -> list:
    """n questions of a second corpus: a Wikipedia vital article asked for by its description ("Which subject is
    described as 'Capital of France'? ..."), its title the one reference answer; the articles whose description
    names the title are left out. A seeded sample, the same on every run. The engine's store (bench_retrieval's)
    holds every lead, so retrieval can find the article; the classifiers were trained on NQ questions alone."""
    import random

    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import QAItem

    leads = [(t, x, d) for t, x, d in wiki_leads() if d and len(d) > 12 and t.lower() not in d.lower()]
    chosen = random.Random(seed).sample(leads, min(n, len(leads)))
    return [QAItem(question=f"Which subject is described as '{d}'? Give its name.", answers=(t,), title=t,
                   passage=x) for t, x, d in chosen]


def _shares(parts: list[tuple], workers: int) -> list[list[tuple]]:
    """The sets (split, n, kind, where) each worker collects: the costliest first, each to the least loaded worker.
    An engine answer costs about twice a protocol one (its passages are the retrieved ones, longer: measured 10
    against 3-5 s per answer on one core), so round-robin gave one worker every engine set."""
    def cost(part):
        return part[1] * (1 if part[2] == "protocol" else 2)

    load, out = [0] * workers, [[] for _ in range(workers)]
    for part in sorted(parts, key=cost, reverse=True):
        i = load.index(min(load))
        out[i].append(part)
        load[i] += cost(part)
    return out


def support_of(data: dict, items, kind: str, engine=None):
    """The support signal (certrag.certify.factuality.answer_support) of answers made before it was recorded: their
    text against the passages they were given, made again -- the protocol's (seeded) sets, or the engine's retrieval
    (engine, default the NQ store of bench_retrieval), which must give the passages' best reranker score recorded
    when the answers were made (else the cached set is stale: SystemExit)."""
    import numpy as np

    from certrag.certify.factuality import answer_support
    from certrag.train.factuality import nq_passage_sets, selected_passages

    if kind == "protocol":
        sets = [passages for passages, _ in nq_passage_sets(items, k=3)]
    else:
        if engine is None:
            from _nq import cached_embedder, nq_store
            from certrag.rerank import CrossEncoderReranker

            engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
        picked = [selected_passages(r) for r in engine.retrieve_batch([it.question for it in items])]
        sets, tops = [p for p, _ in picked], [t for _, t in picked]
        if not np.allclose(np.asarray(tops), data["top_rerank"], atol=1e-3, equal_nan=True):
            raise SystemExit(f"the engine retrieves other passages than when its {kind} answers were made: "
                             "delete the cached set to make it again")
    return np.asarray([answer_support(text, passages) for text, passages in zip(data["predictions"], sets)],
                      dtype=np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-questions", type=int, default=1041,
                   help="first N NQ-open train questions, each answered twice (default: all 1,041)")
    p.add_argument("--test-questions", type=int, default=1081,
                   help="first N NQ-open test questions, each answered twice (default: all 1,081)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--weights", default="q8", choices=("q8", "float32"),
                   help="the reader's weight format (q8: the engine's default; the cached answers are kept apart)")
    p.add_argument("--workers", type=int, default=2,
                   help="processes collecting the four sets of answers (one torch thread and one core each)")
    p.add_argument("--wiki-questions", type=int, default=200,
                   help="held-out questions of a second corpus the classifiers never saw: Wikipedia leads asked for "
                        "by their description (0: none)")
    p.add_argument("--ship", action="store_true",
                   help="write the classifier chosen on train (certrag.train.factuality.choose) into the package, "
                        "its card holding the held-out AUROCs beside the log-probability's")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers must be at least 1")
    _common.pin_threads(1, offset=args.worker or 0)

    import hashlib

    import numpy as np

    from certrag.certify.factuality import SIGNALS, describe_signals
    from certrag.data.nq import load_nq_open
    from certrag.home import certrag_home
    from certrag.train.factuality import (LABEL_RULE, auroc, candidate_models, choose, collect, collect_engine,
                                          combined_features, fit, load_examples, protocol_top_scores, save_examples,
                                          signal_matrix)

    state = {}

    def llm():
        if "llm" not in state:
            from certrag.llm import LocalLLM

            state["llm"] = LocalLLM(args.model, weights=args.weights)
        return state["llm"]

    from certrag.llm.weights import ARITHMETIC
    from certrag.rerank import DEFAULT_RERANKER

    def examples(split: str, n: int, kind: str, where: Path) -> dict:
        items = wiki_items(n) if kind == "wiki" else load_nq_open(split=split)[:n]
        asked = hashlib.sha256("\n".join(it.question for it in items).encode()).hexdigest()[:16]
        meta = {"model": args.model, "weights": args.weights, "split": split, "questions": len(items), "k": 3,
                "top_rerank": "fused", "kind": kind, "question_hash": asked, "arithmetic": ARITHMETIC[args.weights],
                "reranker": DEFAULT_RERANKER,  # it ranks the protocol's distractors and the engine's passages
                "signals": list(SIGNALS)}  # sets made before a signal was recorded are made again
        if kind != "protocol":  # the engine's answers depend on its selection: a changed default remakes them
            from certrag.config import EngineConfig

            meta["selection"] = json.dumps(dataclasses.asdict(EngineConfig().selection), sort_keys=True)
        path = where / f"factuality-{kind}-{split}-{args.model}-{args.weights}-{n}.safetensors"
        from certrag.rerank import CrossEncoderReranker

        if path.exists():
            data, got = load_examples(path)
            if got == meta:
                return data
            if kind == "protocol" and {**got, "reranker": DEFAULT_RERANKER} == meta:
                # the protocol's passages and answers do not depend on the reranker: only their best score does
                data["top_rerank"] = protocol_top_scores(items, CrossEncoderReranker.default(), k=3)
                save_examples(path, data, meta)
                return data
            if {**got, "signals": list(SIGNALS)} == meta and "support" not in got.get("signals", []):
                # answers made before the support signal: it needs only their text and the passages they read
                data["support"] = support_of(data, items, kind)
                save_examples(path, data, meta)
                return data

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
    if args.wiki_questions:
        wanted.append(("test", args.wiki_questions, "wiki", _common.DATA_DIR))
    if args.worker is not None:  # collect this worker's share of the sets (each cached as it is done) and stop
        for part in _shares(wanted, args.workers)[args.worker]:
            examples(*part)
        return
    if args.workers > 1:  # the sets are independent: collect them in parallel, then read them from the cache
        forwarded = ["--train-questions", str(args.train_questions), "--test-questions", str(args.test_questions),
                     "--model", args.model, "--weights", args.weights, "--workers", str(args.workers),
                     "--wiki-questions", str(args.wiki_questions)]
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
    n_protocol = len(parts[("train", "protocol")]["label"])
    engine_part = np.arange(len(train["label"])) >= n_protocol  # the answers the classifier meets at run time
    feats = {"chunks": lambda d: d["chunks"], "full": lambda d: d["full"],
             "combined": lambda d: combined_features(d, "chunks")}
    names = {"chunks": "logistic regression, chunk-wise lookback ratios",
             "full": "logistic regression, full-context lookback ratios",
             "combined": "logistic regression, chunk-wise ratios + mean log-probability"}
    tests = [k for k in ("protocol", "engine", "wiki") if ("test", k) in parts]

    def held_out(row: dict, predict) -> dict:
        """row with the AUROC (and ROC points) of predict(d) -> (labels, scores) on every held-out set."""
        for test_kind in tests:
            label, score = predict(parts[("test", test_kind)])
            row[f"heldout_{test_kind}"] = auroc(label, score)
            row[f"test_n_{test_kind}"] = int(np.isfinite(score).sum())
            row[f"heldout_{test_kind}_points"] = _points(label, score)
        return row

    def finite(*arrays):
        keep = np.ones(len(arrays[0]), dtype=bool)
        for a in arrays:
            keep &= np.isfinite(a).all(1) if a.ndim == 2 else np.isfinite(a)
        return keep

    rows = []
    for kind, feat in feats.items():
        x = feat(train)
        keep = finite(x)
        clf, _ = fit(x[keep], train["label"][keep], model=args.model, kind="chunks" if kind == "combined" else kind,
                     layers=0, heads=0, card={}, judge=engine_part[keep])

        def predict(d, feat=feat, clf=clf):
            kt = finite(feat(d))
            return d["label"][kt], clf.predict_vectors(feat(d)[kt])

        rows.append(held_out({"what": "factuality_auroc", "score": names[kind], "features": x.shape[1],
                              "cv_auroc": clf.card["cv_auroc"], "cv_auroc_engine": clf.card["cv_auroc_judged"],
                              "C": clf.card["C"], "train_n": int(keep.sum())}, predict))
    layers, heads = llm().config.layers, llm().config.heads
    card = {"data": f"{args.model} ({args.weights}) answers, greedy, at most 24 tokens, to the first "
                    f"{args.train_questions} NQ-open train questions twice: from 3 passages (the gold one for half, "
                    "MiniLM-nearest other gold passages as distractors) and from the engine's own retrieval and "
                    f"selection (bench_retrieval's store), reranked by {DEFAULT_RERANKER}", "weights": args.weights,
            "reranker": DEFAULT_RERANKER, "label": LABEL_RULE,
            "positives": int(train["label"].sum()), "examples": int(len(train["label"])),
            "remake": f"python benchmarks/bench_factuality.py --ship --model {args.model} --weights {args.weights} "
                      f"--train-questions {args.train_questions}",
            "made": time.strftime("%Y-%m-%d", time.gmtime())}
    # the candidates the shipped one is chosen from, fitted once: their rows, then the choice
    candidates = candidate_models(train, model=args.model, layers=layers, heads=heads, card=card, judge=engine_part)

    def scores(clf, d):
        """A classifier's score of every answer (NaN where an input is missing)."""
        s = signal_matrix(d, clf.signals)
        out = np.full(len(d["label"]), np.nan)
        if not clf.needs_lookback:
            kt = finite(s)
            out[kt] = clf.predict_vectors(s[kt])
        else:
            kt = finite(d[clf.kind], s)
            out[kt] = clf.predict_vectors(d[clf.kind][kt], s[kt] if clf.stack else None)
        return out

    def predictor(clf):
        def predict(d):
            score = scores(clf, d)
            kt = np.isfinite(score)
            return d["label"][kt], score[kt]
        return predict

    def classifier_row(clf, score: str) -> dict:
        x = signal_matrix(train, clf.signals)
        if clf.needs_lookback:
            x = np.column_stack([train[clf.kind], x])
        return held_out({"what": "factuality_auroc", "score": score,
                         "features": clf.mean.size + (len(clf.stack.inputs) if clf.stack else 0),
                         "cv_auroc": clf.card["cv_auroc"], "cv_auroc_engine": clf.card["cv_auroc_judged"],
                         "C": clf.card["C"], "train_n": int(finite(x).sum())}, predictor(clf))

    if "signals" in candidates:
        rows.append(classifier_row(candidates["signals"], "logistic regression, free signals ("
                                  f"{describe_signals(candidates['signals'].signals)})"))
    # the block's score and the free signals joined by a second regression: the mean log-probability, or all
    for name in ("chunks", "full", "chunks+signals", "full+signals"):
        if name in candidates:
            kind = name.split("+")[0]
            joined_with = "mean log-probability" if name == kind else "the free signals"
            rows.append(classifier_row(candidates[name], f"stacked: {names[kind].split(', ')[1]} model, then its "
                                       f"score + {joined_with}"))
    shipped, _ = choose(train, model=args.model, layers=layers, heads=heads, card=card, judge=engine_part,
                        candidates=candidates)

    shipped_row = classifier_row(shipped, f"**shipped** (chosen on train): {shipped.card['chosen']}")
    rows.append(shipped_row)
    for key, name in (("mean_logprob", "mean token log-probability (baseline)"),
                      ("min_logprob", "minimum token log-probability (no training)"),
                      ("first_logprob", "first token's log-probability (no training)"),
                      ("top_rerank", "best fused reranker score of the passages (baseline)"),
                      ("support", "share of the answer's words found in one of its passages (no training)")):
        rows.append(held_out({"what": "factuality_auroc", "score": name, "features": 1,
                              "cv_auroc": auroc(train["label"], train[key]),
                              "cv_auroc_engine": auroc(train["label"][engine_part], train[key][engine_part]),
                              "C": None,
                              "train_n": int(np.isfinite(train[key]).sum())},
                             lambda d, key=key: (d["label"], d[key])))
    for r in rows:
        print({k: v for k, v in r.items() if not k.endswith("_points")}, file=sys.stderr)
    logprob = next(r for r in rows if r["score"].startswith("mean token log-probability"))
    gain_ci = {k: auroc_gain(parts[("test", k)]["label"], scores(shipped, parts[("test", k)]),
                             parts[("test", k)]["mean_logprob"]) for k in tests}
    shipped_row["gain_over_logprob"] = gain_ci
    if args.ship:
        from certrag.certify.factuality import PACKAGE_DIR

        gains = {k: shipped_row[f"heldout_{k}"] - logprob[f"heldout_{k}"] for k in tests}
        about = (f"{shipped.describe()}; "
                 f"held-out AUROC {shipped_row['heldout_engine']:.3f} against the log-probability's "
                 f"{logprob['heldout_engine']:.3f} on the engine's NQ-open test answers")
        shipped = dataclasses.replace(shipped, card={
            **shipped.card, "summary": about, "heldout_auroc": round(shipped_row["heldout_engine"], 4),
            "logprob_heldout_auroc": round(logprob["heldout_engine"], 4),
            "heldout": {k: {"auroc": round(shipped_row[f"heldout_{k}"], 4),
                            "logprob_auroc": round(logprob[f"heldout_{k}"], 4), "gain": round(gains[k], 4),
                            "gain_95ci": [round(gain_ci[k]["lo"], 4), round(gain_ci[k]["hi"], 4)],
                            "n": shipped_row[f"test_n_{k}"]} for k in tests},
            "heldout_sets": {"protocol": f"first {args.test_questions} NQ-open test questions, 3-passage protocol",
                             "engine": f"first {args.test_questions} NQ-open test questions, the engine's retrieval",
                             "wiki": f"{args.wiki_questions} Wikipedia vital articles asked for by their description "
                                     "(bench_factuality.wiki_items), the engine's retrieval"}})
        shipped.save(PACKAGE_DIR / f"{args.model}.json")
        print(f"shipped {PACKAGE_DIR / (args.model + '.json')}: {shipped.card['chosen']}", file=sys.stderr)
    bal = {f"{s} {k}": (float(d["label"].mean()), float(d["label"][d["with_gold"] == 1].mean()),
                        float(d["label"][d["with_gold"] == 0].mean())) for (s, k), d in parts.items()}
    meta = _common.meta({"bench": "bench_factuality", "model": args.model, "weights": args.weights,
                         "train_questions": args.train_questions, "test_questions": args.test_questions,
                         "wiki_questions": args.wiki_questions})
    best = max(rows, key=lambda r: r["heldout_engine"])
    text = "\n".join([
        "### P(correct) from lookback ratios and token probabilities (bench_factuality.py)\n",
        "**Verdict:** on the engine's own answers to held-out NQ-open test questions the best score is "
        f"{best['score']} "
        f"(AUROC {best['heldout_engine']:.3f}; the log-probability baseline {logprob['heldout_engine']:.3f}); the "
        f"classifier chosen on train to ship scores {shipped_row['heldout_engine']:.3f} there"
        + (f" and {shipped_row['heldout_wiki']:.3f} against the log-probability's {logprob['heldout_wiki']:.3f} on "
           "the second corpus (Wikipedia articles asked for by their description, never trained on)" if "wiki" in tests
           else "") + ". Lookback Lens reports up to 0.82 (full context) and the certification paper 0.77 "
        f"(chunk-wise) with 8B models; these are {args.model}'s ({args.weights} weights).\n",
        f"Answers of {args.model} (greedy, at most 24 tokens); label = a reference answer contained in the answer "
        "(the field is `p_correct`). Share correct (all / with the gold passage among the passages / without): "
        + "; ".join(f"{name} {v[0]:.2f} / {v[1]:.2f} / {v[2]:.2f}" for name, v in bal.items()) + ". Classifiers "
        "are trained on train protocol + train engine answers; the one shipped is chosen by its cross-validated AUROC "
        "on the train engine answers.\n",
        "The shipped classifier's AUROC minus the mean log-probability's on the same held-out answers, with a 95% "
        "paired bootstrap interval (2,000 resamples): "
        + "; ".join(f"{k} {g['gain']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] (n = {g['n']})"
                    for k, g in gain_ci.items()) + ".\n",
        _common.markdown_table(["score", "features", "AUROC, 5-fold CV on train", "the same, train engine answers"]
                               + [f"AUROC, held-out {k}" for k in tests] + ["C", "train n", "test n"],
                               [[r["score"], r["features"], r["cv_auroc"], r["cv_auroc_engine"]]
                                + [r[f"heldout_{k}"] for k in tests]
                                + [r["C"], r["train_n"], " / ".join(str(r[f"test_n_{k}"]) for k in tests)]
                                for r in rows]),
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
