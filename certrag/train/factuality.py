"""Training the factuality classifier (certrag.certify.factuality) on lookback ratios.

Training data (`certrag train-factuality`): answers that a local model generates to NQ-open *train* questions
(certrag.data.nq), each from k passages of which the gold passage is one for half the questions (chosen by a stable
hash) and the others are the gold passages of other NQ questions most similar to the question (MiniLM): hard
distractors; and, with an engine, the model's answers from the engine's own retrieval (collect_engine: the
reranked, selected passages the engine would send), the distribution the classifier meets at run time. Label rule:
1 when a gold answer, DPR-normalised, occurs in the normalised answer ("gold string contained";
certrag.eval.metrics.answer_in_text), else 0. Classifier: standardisation and L2-regularised logistic
regression, C chosen by stratified cross-validated AUROC (scikit-learn).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from certrag.certify.factuality import (LABEL, SIGNALS, FactualityClassifier, Stack, answer_signals,
                                       describe_signals)
from certrag.data.splits import stable_fraction

log = logging.getLogger(__name__)
LABEL_RULE = "gold answer contained in the normalised prediction (DPR normalisation)"


def fit(x: np.ndarray, y: np.ndarray, *, model: str, kind: str, layers: int, heads: int, card: dict,
        cs=(0.001, 0.01, 0.1, 1.0), folds: int = 5, seed: int = 0, inputs: tuple[str, ...] = (),
        judge: np.ndarray | None = None) -> tuple[FactualityClassifier, dict]:
    """Standardise, choose C by stratified cross-validated AUROC on (x, y), refit on all (inputs: a "signals"
    classifier's signal names, x's columns). judge: a mask of the examples whose out-of-fold AUROC the card also
    states (card["cv_auroc_judged"]; choose() weighs candidates by it). Returns the classifier and the
    cross-validation report."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    if len(np.unique(y)) < 2:
        raise ValueError("the training labels are all the same: need both supported and unsupported answers")
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    z = (x - mean) / scale
    report, preds = {}, {}
    for c in cs:
        pred = np.zeros(len(y))
        for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed).split(z, y):
            lr = LogisticRegression(C=c, max_iter=2000).fit(z[tr], y[tr])
            pred[te] = lr.decision_function(z[te])
        report[c], preds[c] = float(roc_auc_score(y, pred)), pred
    best = max(report, key=report.get)
    judged = {} if judge is None else {"cv_auroc_judged": auroc(y[judge], preds[best][judge])}
    lr = LogisticRegression(C=best, max_iter=2000).fit(z, y)
    clf = FactualityClassifier(model=model, kind=kind, layers=layers, heads=heads, mean=mean, scale=scale,
                               coef=lr.coef_[0].astype(np.float64), intercept=float(lr.intercept_[0]),
                               inputs=tuple(inputs),
                               card={**card, "C": best, "cv_auroc": report[best], "cv_folds": folds,
                                     "cv_by_C": {str(k): v for k, v in report.items()}, **judged})
    return clf, report


# ---------------------------------------------------------------------------------------- training examples

def nq_passage_sets(items, k: int = 3, seed: int = 0) -> list[tuple[list[str], bool]]:
    """For each NQ-open item: k passages (gold included for half of the items, by a stable hash) and whether the
    gold is among them. Distractors: the other NQ gold passages nearest the question under MiniLM."""
    from certrag.data.nq import load_nq_open
    from certrag.embed import Embedder, EmbeddingCache
    from certrag.home import certrag_home

    pool = sorted({it.gold_text for it in load_nq_open()})
    embedder = Embedder(cache=EmbeddingCache(certrag_home() / "embeddings-all-MiniLM-L6-v2.safetensors"))
    pv = embedder.embed(pool)
    qv = embedder.embed([it.question for it in items])
    out = []
    for it, q in zip(items, qv):
        with_gold = stable_fraction(f"{seed}:gold:{it.question}") < 0.5
        order = np.argsort(-(pv @ q))
        distractors = [pool[i] for i in order if pool[i] != it.gold_text][: k - 1 if with_gold else k]
        passages = distractors + ([it.gold_text] if with_gold else [])
        rng = np.random.default_rng(int(stable_fraction(f"{seed}:order:{it.question}") * 2**32))
        rng.shuffle(passages)
        out.append((passages, with_gold))
    return out


def collect(llm, items, *, k: int = 3, max_new_tokens: int = 24, reranker=None, progress: bool = True) -> dict:
    """Generates an answer per item with lookback recording; returns arrays: chunks, full (n, layers*heads), the
    answer's free signals (n, each: certrag.certify.factuality.SIGNALS; top_rerank is the best *fused* reranker
    score of the passages, the score the engine ranks by), label, with_gold (n,), and the predictions."""
    sets = nq_passage_sets(items, k=k)
    tops = protocol_top_scores(items, reranker, k=k, sets=sets)
    return _answer_all(llm, [(it, passages, int(with_gold), top)
                             for it, (passages, with_gold), top in zip(items, sets, tops)], max_new_tokens, progress)


def protocol_top_scores(items, reranker, *, k: int = 3, sets: list | None = None) -> np.ndarray:
    """The best fused reranker score of each item's protocol passages (collect's top_rerank; NaN without a
    reranker). The passages do not depend on the reranker, so neither do the answers: a new reranker needs only
    these. sets: nq_passage_sets(items, k), when the caller has them."""
    from certrag.embed import Embedder, EmbeddingCache
    from certrag.home import certrag_home

    if reranker is None:
        return np.full(len(items), np.nan, dtype=np.float32)
    sets = nq_passage_sets(items, k=k) if sets is None else sets
    embedder = Embedder(cache=EmbeddingCache(certrag_home() / "embeddings-all-MiniLM-L6-v2.safetensors"))
    tops = []
    for it, (passages, _) in zip(items, sets):
        q, p = embedder.embed([it.question]), embedder.embed(passages)
        tops.append(float(reranker.score(it.question, passages, (p @ q[0]).astype(np.float32)).max()))
    return np.asarray(tops, dtype=np.float32)


def collect_engine(engine, llm, items, *, max_new_tokens: int = 24, progress: bool = True) -> dict:
    """As collect, over the engine's own retrieval: each question answered from the passages the engine selects
    (reranked, gradient-cut), top_rerank their best fused score; with_gold says whether the gold passage is among
    them."""
    rows = []
    for it, r in zip(items, engine.retrieve_batch([it.question for it in items])):
        passages, top = selected_passages(r)
        with_gold = int(any(t.strip() == it.gold_text.strip() for t in passages))
        rows.append((it, passages, with_gold, top))
    return _answer_all(llm, rows, max_new_tokens, progress)


def selected_passages(r) -> tuple[list[str], float]:
    """A retrieval's selected passages, as the reader is given them, and their best fused reranker score (NaN when
    they were not reranked): what collect_engine records for an engine answer."""
    scores = r.rerank_scores[: r.selected]
    top = float(np.nanmax(scores)) if r.selected and np.isfinite(scores).any() else math.nan
    return list(r.selected_texts), top


def _answer_all(llm, rows, max_new_tokens: int, progress: bool) -> dict:
    from tqdm.auto import tqdm

    from certrag.eval.metrics import answer_in_text
    from certrag.llm.prompts import Passage, plain_messages

    out = {"chunks": [], "full": [], **{name: [] for name in SIGNALS}, "label": [], "with_gold": [], "steps": []}
    predictions = []
    started = time.perf_counter()
    for it, passages, with_gold, top in tqdm(rows, desc="answering", disable=not progress):
        g = llm.generate(plain_messages(it.question, [Passage(p) for p in passages]),
                         max_new_tokens=max_new_tokens, record_lookback=True)
        f = g.lookback
        out["chunks"].append(f.vector("chunks"))
        out["full"].append(f.vector("full"))
        signals = {**answer_signals(g.token_logprobs, [top], answer=g.text, passages=passages),
                   "mean_logprob": g.mean_logprob}  # as answering's
        for name in SIGNALS:
            out[name].append(signals[name])
        out["steps"].append(f.steps)
        out["label"].append(int(answer_in_text(g.text, it.answers)))
        out["with_gold"].append(with_gold)
        predictions.append(g.text)
    data = {key: np.asarray(v, dtype=np.float32 if key in ("chunks", "full", *SIGNALS) else np.int64)
            for key, v in out.items()}
    data["seconds"] = time.perf_counter() - started
    data["predictions"] = predictions
    return data


def combined_features(data: dict, kind: str = "chunks") -> np.ndarray:
    """Lookback ratios with the answer's mean token log-probability appended as one more feature."""
    return np.concatenate([data[kind], data["mean_logprob"][:, None]], axis=1)


def fit_stacked(x: np.ndarray, extra: np.ndarray, y: np.ndarray, *, folds: int = 5, seed: int = 0,
                inputs: tuple[str, ...] = ("mean_logprob",), judge: np.ndarray | None = None,
                **block_args) -> FactualityClassifier:
    """Stacking: the block model (fit, C by cross-validation) is refitted per fold to give every training example
    an out-of-fold decision value; a logistic regression on [that value, extra] (extra: the answer's free signals
    named by inputs, (n,) for one, (n, len(inputs)) for several; by default the mean log-probability) is the second
    level, kept at its own weight where appending them as features among hundreds lets the block's penalty shrink
    them with the rest. Out-of-fold values keep the second level from trusting a block score that has seen its own
    labels. card["cv_auroc"] is the second level's, on the out-of-fold values (card["cv_auroc_judged"] the same on
    the examples judge marks, when given)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold

    x = np.asarray(x, dtype=np.float64)
    extra = np.asarray(extra, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    if extra.ndim == 1:
        extra = extra[:, None]
    if extra.shape != (len(x), len(inputs)):
        raise ValueError(f"extra must have one value per example ({len(x)}) and input ({len(inputs)}: "
                         f"{', '.join(inputs)}); got shape {extra.shape}")
    block, _ = fit(x, y, folds=folds, seed=seed, **block_args)
    oof = np.zeros(len(y))
    for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed + 1).split(x, y):
        mean, scale = x[tr].mean(0), x[tr].std(0)
        scale[scale == 0] = 1.0
        lr = LogisticRegression(C=block.card["C"], max_iter=2000).fit((x[tr] - mean) / scale, y[tr])
        oof[te] = lr.decision_function((x[te] - mean) / scale)
    second = np.column_stack([oof, extra])
    mean2, scale2 = second.mean(0), second.std(0)
    scale2[scale2 == 0] = 1.0
    z = (second - mean2) / scale2
    pred = np.zeros(len(y))
    for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed + 2).split(z, y):
        pred[te] = LogisticRegression(max_iter=2000).fit(z[tr], y[tr]).decision_function(z[te])
    lr = LogisticRegression(max_iter=2000).fit(z, y)
    stack = Stack(mean=mean2, scale=scale2, coef=lr.coef_[0].astype(np.float64), intercept=float(lr.intercept_[0]),
                  inputs=tuple(inputs))
    judged = {} if judge is None else {"cv_auroc_judged": auroc(y[judge], pred[judge])}
    card = {**block.card, "block_cv_auroc": block.card["cv_auroc"], "cv_auroc": float(roc_auc_score(y, pred)),
            **judged,
            "features": f"{block.card.get('features', block.kind + ' lookback ratios')} -> stacked with "
                        f"{describe_signals(inputs)}"}
    return dataclasses.replace(block, stack=stack, card=card)


def fit_logprob(mean_logprob: np.ndarray, y: np.ndarray, *, model: str, card: dict, folds: int = 5,
                seed: int = 0, judge: np.ndarray | None = None) -> FactualityClassifier:
    """The free baseline, calibrated: a logistic regression on the mean token log-probability alone (its AUROC is
    the raw score's; its output is a probability)."""
    clf, _ = fit(np.asarray(mean_logprob, dtype=np.float64)[:, None], y, model=model, kind="logprob", layers=0,
                 heads=0, card={**card, "features": "mean token log-probability of the answer"}, cs=(1.0,),
                 folds=folds, seed=seed, judge=judge)
    return clf


def signal_matrix(data: dict, inputs) -> np.ndarray:
    """The (n, len(inputs)) free signals of collected answers (NaN columns for sets collected before a signal was
    recorded)."""
    n = len(data["label"])
    return np.column_stack([np.asarray(data[name], dtype=np.float64) if name in data else np.full(n, np.nan)
                            for name in inputs])


def fit_signals(train: dict, *, model: str, card: dict, inputs=SIGNALS, folds: int = 5, seed: int = 0,
                judge: np.ndarray | None = None) -> FactualityClassifier:
    """A free model: logistic regression on the answers' free signals (no lookback ratios) against their labels, C
    by cross-validation; answers missing a signal are left out of the fit (and of judge, a mask as fit's)."""
    x = signal_matrix(train, inputs)
    keep = np.isfinite(x).all(1)
    clf, _ = fit(x[keep], np.asarray(train["label"])[keep], model=model, kind="signals", layers=0, heads=0,
                 card={**card, "features": describe_signals(inputs)}, folds=folds, seed=seed, inputs=tuple(inputs),
                 judge=None if judge is None else np.asarray(judge, dtype=bool)[keep])
    return clf


def carried_signals(train: dict) -> tuple[str, ...]:
    """The free signals (SIGNALS, in order) the training answers carry: a set collected before a signal was
    recorded lacks it (no column, or a NaN one), and a model cannot learn what it was never shown. A signal a few
    answers lack (an empty answer has no token log-probability) is carried; the fits reading it leave those out."""
    n = len(train["label"])
    return tuple(name for name in SIGNALS
                 if name in train and len(train[name]) == n and np.isfinite(np.asarray(train[name], float)).any())


def candidate_models(train: dict, *, model: str, layers: int, heads: int, card: dict,
                     judge: np.ndarray | None = None) -> dict[str, FactualityClassifier]:
    """The candidates choose() weighs, each fitted on all the training answers: "logprob" (the calibrated mean
    log-probability), "signals" (a logistic regression on all the free signals the answers carry:
    carried_signals), and "full" / "chunks" (the lookback model stacked with the mean log-probability) and
    "full+signals" / "chunks+signals" (stacked with all those signals); the ones needing more than one signal only
    when the answers carry more. judge: a mask as fit's, each card then holding its out-of-fold AUROC on those
    answers ("cv_auroc_judged")."""
    y = np.asarray(train["label"], dtype=np.int64)
    lp = np.asarray(train["mean_logprob"], dtype=np.float64)
    judge = None if judge is None else np.asarray(judge, dtype=bool)
    if judge is not None and (judge.shape != y.shape or len(np.unique(y[judge])) < 2):
        raise ValueError(f"judge must mark some of the {len(y)} training answers, of both labels")
    carried = carried_signals(train)
    has_signals = len(carried) > 1

    def part(keep):
        return None if judge is None else judge[keep]

    candidates = {}
    keep = np.isfinite(lp)
    candidates["logprob"] = fit_logprob(lp[keep], y[keep], model=model, card=card, judge=part(keep))
    if has_signals:
        candidates["signals"] = fit_signals(train, model=model, card=card, inputs=carried, judge=judge)
    for kind in ("full", "chunks"):
        x = np.asarray(train[kind], dtype=np.float64)
        block_card = {**card, "features": f"{kind} lookback ratios, one per (layer, head), averaged over decode steps"}
        for name, inputs in ((kind, ("mean_logprob",)), (f"{kind}+signals", carried)):
            if name.endswith("+signals") and not has_signals:
                continue
            extra = signal_matrix(train, inputs)
            keep = np.isfinite(x).all(1) & np.isfinite(extra).all(1)
            candidates[name] = fit_stacked(x[keep], extra[keep], y[keep], model=model, kind=kind, layers=layers,
                                           heads=heads, inputs=inputs, card=block_card, judge=part(keep))
    return candidates


def choose(train: dict, *, model: str, layers: int, heads: int, card: dict, margin: float = 0.01,
           judge: np.ndarray | None = None, judged: str = "train's engine answers",
           candidates: dict[str, FactualityClassifier] | None = None) -> tuple[FactualityClassifier, dict]:
    """The classifier to ship for `model`, chosen on the training answers alone by cross-validated AUROC among
    candidate_models(train, ...) (or `candidates`, fitted by it with the same judge: a benchmark that also reports
    them fits them once). judge (a mask) names the answers the AUROC is weighed on -- the engine's own answers, the
    ones it meets at run time, when the training set also holds answers written under another protocol (default:
    all; judged: what they are, for the card). Any but the calibrated mean log-probability must beat it by at least
    `margin` (a stack over pure-noise ratios came out 0.002 above it on 800 synthetic answers: cross-validation noise
    must not buy a model hundreds of weights). Returns the chosen one and every candidate's CV AUROC (on the judged
    answers)."""
    if candidates is None:
        candidates = candidate_models(train, model=model, layers=layers, heads=heads, card=card, judge=judge)
    score = "cv_auroc" if judge is None else "cv_auroc_judged"
    report = {k: float(c.card[score]) for k, c in candidates.items()}
    best = max((k for k in report if k != "logprob"), key=report.get)
    if report[best] < report["logprob"] + margin:
        best = "logprob"
    chosen = candidates[best]
    on = "train" if judge is None else judged
    if best == "logprob":
        why = (f"the calibrated mean log-probability: no other candidate beat it by {margin} AUROC in "
               f"cross-validation on {on}")
    else:
        made_of = ("a logistic regression on " if best == "signals"
                   else f"stacked {best.split('+')[0]} lookback ratios + ")
        why = (f"{made_of}{describe_signals(chosen.signals)}: the best cross-validated AUROC on {on}, at least "
               f"{margin} above the calibrated mean log-probability's")
    chosen = dataclasses.replace(chosen, card={**chosen.card, "chosen": why, "cv_auroc_by_candidate": report,
                                               "chosen_on": on})
    return chosen, report


def save_examples(path: str | Path, data: dict, meta: dict) -> None:
    """Arrays in safetensors, predictions and meta in the header's metadata (strings)."""
    from safetensors.numpy import save

    from certrag.atomic import write_file_atomic

    arrays = {k: np.ascontiguousarray(v) for k, v in data.items() if isinstance(v, np.ndarray)}
    metadata = {"meta": json.dumps(meta), "predictions": json.dumps(data["predictions"])}
    write_file_atomic(Path(path), save(arrays, metadata=metadata))


def load_examples(path: str | Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="numpy") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
        md = f.metadata() or {}
    out["predictions"] = json.loads(md.get("predictions", "[]"))
    return out, json.loads(md.get("meta", "{}"))


def train_factuality(model: str, out: str | Path, *, questions: int = 800, k: int = 3,
                     examples: str | Path | None = None, progress: bool = True) -> FactualityClassifier:
    """Collects (or reuses, from `examples`) the answers of `model` to the first `questions` NQ-open train questions
    (k passages each, the protocol of `collect`) and fits the classifier `choose` picks. The shipped classifiers
    are made by `python benchmarks/bench_factuality.py --ship`, which adds the engine's own answers."""
    from certrag.data.nq import load_nq_open
    from certrag.llm import LocalLLM

    items = load_nq_open(split="train")[:questions]
    llm = LocalLLM(model)
    meta = {"model": model, "weights": getattr(llm, "weights", ""), "split": "train", "questions": len(items),
            "k": k, "question_hash": hashlib.sha256("\n".join(it.question for it in items).encode()).hexdigest()[:16]}
    data = None
    if examples is not None and Path(examples).exists():
        data, got = load_examples(examples)
        if got != meta:
            log.info("examples at %s were made with other settings; collecting again", examples)
            data = None
    if data is None:
        from certrag.rerank import CrossEncoderReranker

        data = collect(llm, items, k=k, reranker=CrossEncoderReranker.default(), progress=progress)
        if examples is not None:
            save_examples(examples, data, meta)
    card = {"data": f"NQ-open train split, first {len(items)} questions; {k} passages each (gold for half, "
                    "MiniLM-nearest other NQ gold passages as distractors)",
            "weights": meta["weights"], "label": LABEL, "label_rule": LABEL_RULE,
            "positives": int(data["label"].sum()), "examples": int(len(data["label"])),
            "remake": f"certrag train-factuality --model {model} --questions {questions}",
            "made": time.strftime("%Y-%m-%d", time.gmtime())}
    clf, _ = choose(data, model=model, layers=llm.config.layers, heads=llm.config.heads, card=card)
    clf.save(out)
    return clf


def auroc(y: np.ndarray, score: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    keep = np.isfinite(score)
    y, score = np.asarray(y)[keep], np.asarray(score)[keep]
    return float(roc_auc_score(y, score)) if len(np.unique(y)) == 2 else math.nan
