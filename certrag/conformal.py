"""Certified retrieval: a split-conformal threshold on retrieval scores, and the diagnostics that say when it holds.

A calibration set holds (question, reference answers, optional source passage or source id) items. For each, the
engine retrieves and reranks its N candidates; a candidate is *correct* when it is the source (same document id, or
its text is a piece of the source passage: RougeL precision against it >= source_threshold) or when a reference
answer is found in it (RougeL recall of the answer >= answer_threshold; Google's `rouge-score`, the implementation
the ROUGE-reporting papers use). The score is the (fused) reranker logit, or the cosine similarity when no reranker
runs: split conformal needs only one scalar per candidate on a fixed scale, is unchanged by any monotone transform,
and raw logits cannot saturate the way a sigmoid of large logits does.

The nonconformity score of an item is minus the score of its best correct candidate (+inf when no correct candidate
was retrieved), and the threshold is the split-conformal quantile: with n items, the ceil((n+1)(1-alpha))-th
smallest nonconformity score q, and s_thres = -q. On exchangeable data the candidates scoring at least s_thres then
hold a correct one with probability at least 1 - alpha (Vovk et al. 2005; Angelopoulos & Bates 2021) -- but only
among what the retriever surfaced: when it does not surface correct chunks, no threshold can reach 1 - alpha.
The diagnostics say which case holds: m1 (fraction of questions with at least one trusted candidate), m2 (mean
fraction of candidates trusted) and the empirical coverage on held-out items beside 1 - alpha.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

CALIBRATION_FILE = "calibration.json"
FORMAT_VERSION = 1


class CalibrationError(ValueError):
    """A calibration set or a stored calibration that cannot be used, with the reason."""


# ---------------------------------------------------------------------------------------------- the statistics

def min_calibration_size(alpha: float) -> int:
    """The smallest n for which the split-conformal quantile is finite: ceil((n+1)(1-alpha)) <= n."""
    _check_alpha(alpha)
    n = 1
    while _rank(n, alpha) > n:
        n += 1
    return n


def _rank(n: int, alpha: float) -> int:
    # ceil((n+1)(1-alpha)), so that a product that is an integer in exact arithmetic (10 * 0.9) does not round up
    # by one ulp and then by one rank.
    return math.ceil((n + 1) * (1.0 - alpha) - 1e-9)


def _check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be a number in (0, 1); got {alpha!r}")


def conformal_quantile(nonconformity: Sequence[float] | np.ndarray, alpha: float) -> float:
    """The ceil((n+1)(1-alpha))-th smallest of n nonconformity scores (+inf entries allowed).

    Raises CalibrationError when n is too small for alpha (the quantile would be unbounded)."""
    _check_alpha(alpha)
    r = np.asarray(nonconformity, dtype=np.float64).ravel()
    if np.isnan(r).any():
        raise ValueError("nonconformity scores must not be NaN")
    n = len(r)
    need = min_calibration_size(alpha)
    if n < need:
        raise CalibrationError(f"alpha={alpha} needs at least {need} calibration items; got {n}")
    return float(np.sort(r)[_rank(n, alpha) - 1])


def score_transform_name(reranked: bool) -> str:
    return "rerank logit" if reranked else "cosine"


def calibrated_scores(rerank_scores: np.ndarray, dense_scores: np.ndarray, transform: str) -> np.ndarray:
    """Candidate scores on the calibration's scale (float64), in the retrieval's order."""
    if transform == "rerank logit":
        x = np.asarray(rerank_scores, dtype=np.float64)
        if np.isnan(x).any():
            raise CalibrationError("the calibration is on reranker scores, but this retrieval ran without the "
                                   "reranker")
        return x
    if transform == "cosine":
        return np.asarray(dense_scores, dtype=np.float64)
    raise CalibrationError(f"unknown score transform {transform!r}")


# ------------------------------------------------------------------------------------------- calibration data

@dataclass(frozen=True, kw_only=True)
class CalibrationItem:
    """question; answers: reference answers; source_id: the id of the document that holds the answer (as the store
    names it); source_text: the source passage's text. Either source is optional."""

    question: str
    answers: tuple[str, ...]
    source_id: str | None = None
    source_text: str | None = None


def load_calibration_items(data: object) -> list[CalibrationItem]:
    """A JSONL path (one object per line: question, answers (list) or answer (string), optional source_id and
    source), the literal 'nq-open:calibration' (the bundled NQ-open calibration split, with its gold passages), or
    a list of CalibrationItem / dicts of the same fields."""
    if isinstance(data, str) and data.startswith("nq-open:"):
        from certrag.eval.nq import SPLITS, load_nq_open

        split = data.split(":", 1)[1]
        if split not in SPLITS:
            raise ValueError(f"data: unknown NQ-open split {split!r}; one of {SPLITS}")
        return [CalibrationItem(question=it.question, answers=tuple(it.answers), source_text=it.gold_text)
                for it in load_nq_open(split=split)]
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"data: no such file: {path}")
        rows = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{line_no}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise CalibrationError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
    elif isinstance(data, Iterable):
        rows = [(f"item {i}", row) for i, row in enumerate(data)]
    else:
        raise TypeError(f"data must be a JSONL path or a list of items; got {type(data).__name__}")
    items = []
    for where, row in rows:
        if isinstance(row, CalibrationItem):
            items.append(row)
            continue
        if not isinstance(row, dict):
            raise CalibrationError(f"{where}: each item must be an object")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise CalibrationError(f"{where}: missing field 'question' (a non-empty string)")
        answers = row.get("answers", row.get("answer"))
        if isinstance(answers, str):
            answers = [answers]
        if (not isinstance(answers, list) or not answers
                or not all(isinstance(a, str) and a.strip() for a in answers)):
            raise CalibrationError(f"{where}: missing field 'answers' (a list of non-empty strings) or 'answer'")
        source_id, source = row.get("source_id"), row.get("source")
        if source_id is not None and not isinstance(source_id, (str, int)):
            raise CalibrationError(f"{where}: 'source_id' must be a string")
        if source is not None and not isinstance(source, str):
            raise CalibrationError(f"{where}: 'source' must be a string")
        items.append(CalibrationItem(question=question, answers=tuple(answers),
                                     source_id=None if source_id is None else str(source_id), source_text=source))
    if not items:
        raise CalibrationError("data: the calibration set is empty")
    return items


class ChunkJudge:
    """Decides which candidates are correct for an item (see the module docstring); RougeL from `rouge-score`."""

    def __init__(self, *, answer_threshold: float = 0.8, source_threshold: float = 0.9) -> None:
        for name, v in (("answer_threshold", answer_threshold), ("source_threshold", source_threshold)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]; got {v}")
        from rouge_score import rouge_scorer, tokenizers

        self.answer_threshold = answer_threshold
        self.source_threshold = source_threshold
        self._scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        self._tokenize = tokenizers.DefaultTokenizer(use_stemmer=False).tokenize

    def correct(self, item: CalibrationItem, doc_ids: Sequence[str], texts: Sequence[str]) -> np.ndarray:
        out = np.zeros(len(texts), dtype=bool)
        source_tokens = set(self._tokenize(item.source_text)) if item.source_text else None
        for i, (doc_id, text) in enumerate(zip(doc_ids, texts)):
            if item.source_id is not None and doc_id == item.source_id:
                out[i] = True
            elif source_tokens is not None and self._is_piece_of_source(text, item.source_text, source_tokens):
                out[i] = True
            else:
                out[i] = any(self._scorer.score(a, text)["rougeL"].recall >= self.answer_threshold
                             for a in item.answers)
        return out

    def _is_piece_of_source(self, text: str, source: str, source_tokens: set) -> bool:
        tokens = self._tokenize(text)
        if not tokens:
            return False
        # LCS precision <= the fraction of the chunk's tokens found in the source at all: a cheap exact bound that
        # skips the quadratic LCS for unrelated chunks.
        if sum(t in source_tokens for t in tokens) < self.source_threshold * len(tokens):
            return False
        return self._scorer.score(source, text)["rougeL"].precision >= self.source_threshold


# ------------------------------------------------------------------------------------------------ the record

@dataclass(frozen=True, kw_only=True)
class Diagnostics:
    """On held-out items: coverage (a correct candidate among the trusted ones), m1 (at least one trusted), m2 (mean
    fraction of candidates trusted), mean trusted-set size, retrieval_recall (a correct candidate among all
    candidates: the ceiling on coverage at any threshold), and the verdict with its reasons."""

    n_eval: int
    coverage: float | None
    m1: float | None
    m2: float | None
    mean_trusted: float | None
    retrieval_recall: float | None
    holds: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Calibration:
    alpha: float
    s_thres: float | None  # None: unbounded (even every candidate does not reach 1 - alpha on calibration)
    n: int
    score_transform: str
    embedder: str
    reranker: dict | None
    candidates: int
    answer_threshold: float
    source_threshold: float
    created: str
    diagnostics: Diagnostics
    chunks: int | None = None  # the store's size when calibrated: a store that changed since wants recalibrating
    format_version: int = FORMAT_VERSION

    @property
    def holds(self) -> bool:
        return self.diagnostics.holds

    def trusted(self, scores: np.ndarray) -> np.ndarray:
        """Which candidates (scores already on the calibration's scale) clear the threshold."""
        if self.s_thres is None:
            return np.ones(len(scores), dtype=bool)
        return np.asarray(scores) >= self.s_thres

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        try:
            if data.get("format_version", 0) > FORMAT_VERSION:
                raise CalibrationError(f"the calibration was written by a newer certrag (format "
                                       f"{data['format_version']}); upgrade certrag")
            diag = dict(data["diagnostics"])
            diag["reasons"] = tuple(diag.get("reasons", ()))
            return cls(**{**data, "diagnostics": Diagnostics(**diag)})
        except (KeyError, TypeError) as exc:
            raise CalibrationError(f"damaged calibration record ({exc})") from None

    def save(self, path: str | Path) -> None:
        from certrag.store import write_file_atomic

        write_file_atomic(Path(path), (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{path} is unreadable: {exc}") from None

    def check_identity(self, embedder: str, reranker: dict | None) -> None:
        """Refuses a calibration made with another embedder or reranker than the engine's."""
        if embedder != self.embedder:
            raise CalibrationError(f"the calibration was made with the embedder {self.embedder!r}; this store uses "
                                   f"{embedder!r}: recalibrate")
        if reranker != self.reranker:
            raise CalibrationError(f"the calibration was made with the reranker {self.reranker!r}; this engine uses "
                                   f"{reranker!r}: recalibrate")


@dataclass(frozen=True)
class Certification:
    """For one retrieval: the calibrated score and trusted mark of every candidate (in the retrieval's order), how
    many are trusted, whether the filter was applied, and why not when it was not."""

    scores: np.ndarray
    trusted: np.ndarray
    s_thres: float | None
    alpha: float
    applied: bool
    reason: str = ""

    @property
    def trusted_count(self) -> int:
        return int(self.trusted.sum())

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "s_thres": self.s_thres, "applied": self.applied, "reason": self.reason,
                "trusted": self.trusted.tolist(), "scores": [float(s) for s in self.scores]}


# ------------------------------------------------------------------------------------------------ calibrating

def stable_holdout(question: str, fraction: float) -> bool:
    from certrag.segment.train import stable_fraction

    return stable_fraction("holdout:" + " ".join(question.strip().lower().split())) < fraction


@dataclass
class ScoredItems:
    """Per item: the calibrated scores of its candidates (best first) and which are correct."""

    scores: list[np.ndarray] = field(default_factory=list)
    correct: list[np.ndarray] = field(default_factory=list)

    def best_correct(self) -> np.ndarray:
        return np.array([s[c].max() if c.any() else -np.inf for s, c in zip(self.scores, self.correct)])


def threshold(best_correct: np.ndarray, alpha: float) -> float | None:
    """s_thres from the best correct scores of n calibration items (-inf where none was correct); None if
    unbounded."""
    q = conformal_quantile(-np.asarray(best_correct, dtype=np.float64), alpha)
    return None if math.isinf(q) else -q


def diagnose(scored: ScoredItems, s_thres: float | None, alpha: float) -> Diagnostics:
    """The diagnostics of a threshold on held-out items, and the verdict: the guarantee is reported as not holding
    when the threshold is unbounded, or when coverage or m1 falls short of 1 - alpha by more than two binomial
    standard errors (sqrt(alpha (1 - alpha) / n))."""
    n = len(scored.scores)
    reasons = []
    if s_thres is None:
        reasons.append("the calibration quantile is unbounded: on calibration items the retriever does not surface "
                       f"a correct chunk often enough to reach 1 - alpha = {1 - alpha:.2f}")
    if n == 0:
        reasons.append("no held-out items to check coverage on")
        return Diagnostics(n_eval=0, coverage=None, m1=None, m2=None, mean_trusted=None, retrieval_recall=None,
                           holds=False, reasons=tuple(reasons))
    trusted = [np.ones(len(s), bool) if s_thres is None else s >= s_thres for s in scored.scores]
    coverage = float(np.mean([(t & c).any() for t, c in zip(trusted, scored.correct)]))
    m1 = float(np.mean([t.any() for t in trusted]))
    m2 = float(np.mean([t.mean() if len(t) else 0.0 for t in trusted]))
    mean_trusted = float(np.mean([t.sum() for t in trusted]))
    recall = float(np.mean([c.any() for c in scored.correct]))
    slack = 2.0 * math.sqrt(alpha * (1 - alpha) / n)
    if coverage < 1 - alpha - slack:
        reasons.append(f"held-out coverage {coverage:.3f} is below 1 - alpha = {1 - alpha:.2f} by more than two "
                       f"standard errors ({slack:.3f})"
                       + (f"; the retriever surfaces a correct chunk for only {recall:.3f} of questions"
                          if recall < 1 - alpha else ""))
    if m1 < 1 - alpha - slack:
        reasons.append(f"m1 = {m1:.3f}: too few questions have any trusted chunk")
    return Diagnostics(n_eval=n, coverage=coverage, m1=m1, m2=m2, mean_trusted=mean_trusted,
                       retrieval_recall=recall, holds=not reasons, reasons=tuple(reasons))


def score_items(engine, items: list[CalibrationItem], judge: ChunkJudge, *, candidates: int, transform: str,
                batch: int = 32, progress: bool = True) -> ScoredItems:
    from tqdm.auto import tqdm

    from certrag.select import TopKSelector

    out = ScoredItems()
    keep_all = TopKSelector(k=candidates)
    for start in tqdm(range(0, len(items), batch), desc="calibrating", unit="batch",
                      disable=not progress or len(items) <= batch):
        chunk = items[start:start + batch]
        for item, r in zip(chunk, engine.retrieve([it.question for it in chunk], candidates=candidates,
                                                  selector=keep_all)):
            out.scores.append(calibrated_scores(r.rerank_scores, r.dense_scores, transform))
            out.correct.append(judge.correct(item, r.doc_ids, r.texts))
    return out


def calibrate(engine, data: object, *, alpha: float = 0.1, holdout: float = 0.3, eval_data: object = None,
              answer_threshold: float = 0.8, source_threshold: float = 0.9, candidates: int | None = None,
              progress: bool = True) -> tuple[Calibration, ScoredItems, ScoredItems]:
    """Calibrates s_thres on data and checks it on held-out items: eval_data when given, else the `holdout`
    fraction of data chosen by a stable hash of the question. Returns the record and the scored calibration and
    held-out items (for sweeps and plots); Engine.calibrate stores the record with the store."""
    _check_alpha(alpha)
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1); got {holdout}")
    items = load_calibration_items(data)
    if eval_data is not None:
        cal_items, eval_items = items, load_calibration_items(eval_data)
    else:
        cal_items = [it for it in items if not stable_holdout(it.question, holdout)]
        eval_items = [it for it in items if stable_holdout(it.question, holdout)]
    need = min_calibration_size(alpha)
    if len(cal_items) < need:
        raise CalibrationError(f"alpha={alpha} needs at least {need} calibration items; got {len(cal_items)}"
                               + (f" after holding out {len(eval_items)} for the check" if eval_data is None else ""))
    n_cand = candidates or engine.config.retrieval.candidates
    transform = score_transform_name(engine.reranker_identity() is not None)
    judge = ChunkJudge(answer_threshold=answer_threshold, source_threshold=source_threshold)
    cal = score_items(engine, cal_items, judge, candidates=n_cand, transform=transform, progress=progress)
    held = score_items(engine, eval_items, judge, candidates=n_cand, transform=transform, progress=progress)
    s_thres = threshold(cal.best_correct(), alpha)
    record = Calibration(alpha=float(alpha), s_thres=s_thres, n=len(cal_items), score_transform=transform,
                         embedder=engine.embedder_name, reranker=engine.reranker_identity(), candidates=n_cand,
                         answer_threshold=answer_threshold, source_threshold=source_threshold,
                         created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         diagnostics=diagnose(held, s_thres, alpha), chunks=len(engine))
    return record, cal, held


def coverage_sweep(cal: ScoredItems, held: ScoredItems, alphas: Sequence[float]) -> list[dict]:
    """For each alpha: the threshold from cal and the diagnostics on held (the calibration plot's points)."""
    rows = []
    best = cal.best_correct()
    for a in alphas:
        if len(best) < min_calibration_size(a):
            continue
        s = threshold(best, a)
        d = diagnose(held, s, a)
        rows.append({"alpha": a, "target": 1 - a, "s_thres": s, "coverage": d.coverage, "m1": d.m1, "m2": d.m2,
                     "mean_trusted": d.mean_trusted, "holds": d.holds})
    return rows


def plot_sweep(rows: list[dict], path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the calibration plot needs matplotlib: pip install matplotlib") from None
    if not rows:
        raise ValueError("no sweep points to plot: the calibration set is too small for every alpha of the sweep")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="coverage = 1 - alpha")
    ax.plot([r["target"] for r in rows], [r["coverage"] for r in rows], "o-", label="empirical coverage")
    ax.plot([r["target"] for r in rows], [r["m1"] for r in rows], "s:", label="m1")
    lo = min(r["target"] for r in rows)
    ax.set_xlim(lo - 0.02, 1.0)
    ax.set_ylim(min(lo, min(r["coverage"] for r in rows)) - 0.02, 1.0)
    ax.set_xlabel("1 - alpha")
    ax.set_ylabel("held-out rate")
    ax.set_title(title or "conformal retrieval: coverage against target")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
