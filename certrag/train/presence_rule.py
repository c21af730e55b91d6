"""The answer-presence rule shipped beside a reranker (certrag.certify.presence): the best retrieval score and a
reader's log-odds that the best candidate states the answer, fitted to tell answerable NQ-open questions from
off-topic ones.

Store: the default calibration's (certrag.train.default_calibration.nq_store: every NQ-open gold passage and the
bundled Wikipedia leads, one chunk per passage), 20 candidates, the given reranker. Rows: every question of the
NQ-open *calibration* split twice -- answerable (its retrieval as it is) and off-topic (the same retrieval with every
candidate the default calibration's ChunkJudge marks correct removed; questions with nothing left are skipped). Judge:
the bundled reader asked certrag.certify.presence.QUESTION about the best candidate (q8 weights). Threshold: 10% of
the answerable rows flagged. The test split is never read here. Judgments are kept in a JSON file (--cache; default
under CERTRAG_HOME) so an interrupted run resumes.

    python -m certrag.train.presence_rule                     # the default reranker, qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from certrag.certify.presence import PresenceRule

DEFAULT_JUDGE = "qwen2.5-coder-1.5b-instruct"
SPLIT = "calibration"


def row_key(way: str, question: str, passage: str) -> str:
    """A judgment's key in the cache: the split, answerable ("on") or off-topic ("off"), the question, and a hash of
    the passage judged (a store that retrieves another best passage judges again)."""
    import hashlib

    return f"{SPLIT}\t{way}\t{question}\t{hashlib.sha256(passage.encode()).hexdigest()[:16]}"


def judgments(llm, rows: list[tuple[str, str, str]], cache_path: Path, key: dict, *, batch: int = 8) -> dict:
    """{row key: log-odds} for rows (key, question, passage), read from cache_path when it was made under `key`
    and written back after every batch (atomically)."""
    from tqdm.auto import tqdm

    from certrag.atomic import write_file_atomic
    from certrag.certify.presence import log_odds

    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    if cache.get("key") != key:
        cache = {"key": key, "judgments": {}}
    done = cache["judgments"]
    todo = [row for row in rows if row[0] not in done]
    with tqdm(total=len(todo), desc="presence judgments", disable=not todo) as bar:
        for i in range(0, len(todo), batch):
            part = todo[i:i + batch]
            for (k, _, _), v in zip(part, log_odds(llm(), [(q, p) for _, q, p in part])):
                done[k] = float(v)
            write_file_atomic(cache_path, json.dumps(cache).encode())
            bar.update(len(part))
    return done


def fit_rule(on: np.ndarray, off: np.ndarray, *, flagged: float = 0.10, **identity) -> PresenceRule:
    """A PresenceRule from (best score, log-odds) rows of answerable (on) and off-topic (off) questions: a logistic
    regression (standardised features, C = 1) separating them, its threshold the `flagged` quantile of the
    answerable rows' values (so that share of them is flagged). identity: judge, weights, embedder, reranker,
    score_transform, and fit (the record of how it was made; the rule adds what it measured on these rows)."""
    from sklearn.linear_model import LogisticRegression

    from certrag.train.factuality import auroc

    on, off = np.asarray(on, dtype=np.float64), np.asarray(off, dtype=np.float64)
    if len(on) < 10 or len(off) < 10:
        raise ValueError(f"need at least 10 answerable and 10 off-topic rows; got {len(on)} and {len(off)}")
    x = np.r_[on, off]
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    lr = LogisticRegression(max_iter=1000).fit((x - mean) / scale, np.r_[np.ones(len(on)), np.zeros(len(off))])
    w = lr.coef_[0] / scale
    intercept = float(lr.intercept_[0] - (lr.coef_[0] * mean / scale).sum())
    v_on, v_off = on @ w + intercept, off @ w + intercept
    threshold = float(np.quantile(v_on, flagged))
    y = np.r_[np.ones(len(on)), np.zeros(len(off))]
    measured = {"answerable": len(on), "offtopic": len(off), "answerable_flagged": float(np.mean(v_on < threshold)),
                "offtopic_flagged": float(np.mean(v_off < threshold)), "auroc": auroc(y, np.r_[v_on, v_off]),
                "auroc_best_score_alone": auroc(y, x[:, 0]), "auroc_judge_alone": auroc(y, x[:, 1])}
    fit = {**identity.pop("fit", {}), "measured_on_fit_rows": measured}
    return PresenceRule(score_weight=float(w[0]), judge_weight=float(w[1]), intercept=intercept,
                        threshold=threshold, fit=fit, **identity)


def make(reranker_name: str, judge: str = DEFAULT_JUDGE, *, cache: Path | None = None, flagged: float = 0.10) -> Path:
    from certrag.certify.calibration import ChunkJudge, load_calibration_items, without_correct
    from certrag.certify.conformal import calibrated_scores
    from certrag.certify.presence import FILE, QUESTION
    from certrag.home import certrag_home
    from certrag.llm import LocalLLM
    from certrag.llm.models import BUNDLED_MODELS
    from certrag.rerank import PACKAGE_RERANKERS
    from certrag.train.default_calibration import nq_store

    if judge not in BUNDLED_MODELS:
        raise ValueError(f"judge must be a bundled model ({', '.join(sorted(BUNDLED_MODELS))}); got {judge!r}")
    out = Path(PACKAGE_RERANKERS[reranker_name]) / FILE.format(judge=judge)
    items = load_calibration_items(f"nq-open:{SPLIT}")
    with tempfile.TemporaryDirectory(prefix="certrag-nq-store-") as scratch:
        with nq_store(Path(scratch) / "store", reranker_name) as engine:
            cal = engine.calibration
            if cal is None or not cal.source:
                raise RuntimeError(f"the reranker {reranker_name} ships no default calibration: run "
                                   "python -m certrag.train.default_calibration first")
            retrievals = engine.retrieve_batch([it.question for it in items], candidates=20)
            identity = {"embedder": engine.embedder_name, "reranker": engine.reranker_identity(),
                        "score_transform": cal.score_transform}
            backend, store_size = engine.reranker_backend(), len(engine)
    chunk_judge = ChunkJudge(answer_threshold=cal.answer_threshold, source_threshold=cal.source_threshold,
                             span_tokens=cal.span_tokens)
    rows, scored = [], []  # (cache key, question, best passage); (question, way, best score)
    for it, r in zip(items, retrievals):
        off = without_correct(chunk_judge, it, r)
        if off is None:
            continue
        for way, ret in (("on", r), ("off", off)):
            scores = calibrated_scores(ret.rerank_scores, ret.dense_scores, cal.score_transform)
            best = int(np.argmax(scores))
            rows.append((row_key(way, it.question, ret.texts[best]), it.question, ret.texts[best]))
            scored.append((way, float(scores[best])))
    key = {"reader": judge, "weights": "q8", "reranker": reranker_name, "store": store_size, "question": QUESTION}
    path = cache or certrag_home() / f"presence-judgments-{judge}-{reranker_name}.json"
    loaded = []

    def llm():
        if not loaded:
            loaded.append(LocalLLM(judge, weights="q8"))
        return loaded[0]

    found = judgments(llm, rows, Path(path), key)
    x = np.array([[best, found[k]] for (way, best), (k, _, _) in zip(scored, rows)])
    on = x[[way == "on" for way, _ in scored]]
    off = x[[way == "off" for way, _ in scored]]
    how = {"data": f"NQ-open {SPLIT} split ({len(items)} questions; {len(on)} with an off-topic version)",
           "store": f"certrag.train.default_calibration.nq_store ({store_size} chunks), 20 candidates",
           "offtopic": "the same retrieval with every candidate the default calibration's ChunkJudge marks correct "
                       "removed",
           "judge_question": QUESTION, "reranker_backend": backend,
           "threshold_rule": f"{flagged:.0%} of the answerable rows flagged",
           "command": f"python -m certrag.train.presence_rule --reranker {reranker_name} --judge {judge}"}
    rule = fit_rule(on, off, flagged=flagged, judge=judge, weights="q8", fit=how, **identity)
    rule.save(out)
    return out


def main() -> None:
    from certrag.rerank import DEFAULT_RERANKER, PACKAGE_RERANKERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reranker", choices=list(PACKAGE_RERANKERS), default=DEFAULT_RERANKER)
    p.add_argument("--judge", default=DEFAULT_JUDGE, help="the bundled reader that judges")
    p.add_argument("--cache", type=Path, default=None, help="the judgments' JSON (resumed when it exists)")
    args = p.parse_args()
    print(make(args.reranker, args.judge, cache=args.cache))


if __name__ == "__main__":
    main()
