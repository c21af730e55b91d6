"""Certified retrieval: a split-conformal threshold on retrieval scores, and the diagnostics that say when it holds.

A calibration set holds (question, reference answers, optional source passage or source id) items. For each, the
engine retrieves and reranks its N candidates; a candidate is *correct* when it is the source (same document id, or
its text is a piece of the source passage: RougeL precision against it >= source_threshold) or when a reference
answer is found in it (RougeL recall of the answer >= answer_threshold; Google's `rouge-score`, the implementation
the ROUGE-reporting papers use). The score is the (fused) reranker logit, or the cosine similarity when no reranker
runs: split conformal needs only one scalar per candidate on a fixed scale, is unchanged by any monotone transform,
and raw logits cannot saturate the way a sigmoid of large logits does.

The nonconformity score of an item is minus the score of its best correct candidate, and the threshold is the
split-conformal quantile over the calibration items whose candidates hold a correct one (how many were left out is
recorded, n_without_correct): with n such items, the ceil((n+1)(1-alpha))-th smallest nonconformity score q, and
s_thres = -q. On exchangeable data, for a question whose candidates hold a correct chunk, the candidates scoring at
least s_thres hold one with probability at least 1 - alpha (Vovk et al. 2005; Angelopoulos & Bates 2021); the
guarantee is conditional on the retriever surfacing one, and no threshold can do better than that. Leaving the
misses out of the quantile is what lets the diagnostics see them (the certification paper's m1, which falls on its
finqa / tatqa retrievers): counting them as +inf makes the quantile unbounded as soon as more than alpha of the
items are misses, and an unbounded threshold trusts everything, so m1 = 1 whatever the retriever does. The
diagnostics: m1 (fraction of held-out questions with at least one trusted candidate: with a scorer that scores
unrelated chunks low, it falls toward the retriever's recall when the retriever fails), m2 (mean fraction of
candidates trusted), coverage (a correct chunk among the trusted, over all held-out questions) and conditional
coverage (over those whose candidates hold one: the guaranteed quantity), each beside 1 - alpha.

This module holds the statistics and the records (Calibration, Diagnostics, Certification) and applies a stored
calibration to one retrieval (certify); certrag.certify.calibration makes a calibration from items.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

CALIBRATION_FILE = "calibration.json"
DEFAULT_CALIBRATION_FILE = "calibration-nq-open.json"  # beside a packaged reranker: certrag.train.default_calibration
FORMAT_VERSION = 1


class CalibrationError(ValueError):
    """A calibration set or a stored calibration that cannot be used, with the reason."""


# ---------------------------------------------------------------------------------------------- the statistics

def min_calibration_size(alpha: float) -> int:
    """The smallest n for which the split-conformal quantile is finite: ceil((n+1)(1-alpha)) <= n."""
    check_alpha(alpha)
    n = 1
    while _rank(n, alpha) > n:
        n += 1
    return n


def coverage_probability(n: int, alpha: float, at_least: float) -> float:
    """P(the coverage a split-conformal threshold made from n exchangeable items delivers on new questions is at
    least `at_least`). Given the calibration items, coverage is Beta(k, n + 1 - k) with k = ceil((n+1)(1-alpha))
    (Vovk 2012; Angelopoulos and Bates, "A Gentle Introduction to Conformal Prediction", section 3.2); for integer
    parameters P(Beta(k, n+1-k) >= t) = P(Binomial(n, t) <= k - 1), summed here in log space."""
    k = _rank(n, alpha)
    if k > n:
        return 0.0  # no finite threshold
    t = float(at_least)
    if t <= 0.0:
        return 1.0
    if t >= 1.0:
        return 0.0
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(t)
            + (n - j) * math.log1p(-t) for j in range(k)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def items_for_coverage(alpha: float, slack: float = 0.02, probability: float = 0.9, limit: int = 200_000) -> int:
    """How many labelled calibration items make the delivered coverage at least 1 - alpha - slack with the given
    probability (coverage_probability), for this n and every larger one up to the next 1/alpha (the rank's floor
    makes the probability a saw-tooth in n). min_calibration_size is only what makes the threshold finite: with 9
    items at alpha 0.1 the coverage a user gets is anywhere from 0.6 to 1."""
    check_alpha(alpha)
    if not 0.0 < slack < 1.0 - alpha:
        raise ValueError(f"slack must be in (0, 1 - alpha); got {slack!r}")
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1); got {probability!r}")
    run = math.ceil(1.0 / alpha)
    n, good = min_calibration_size(alpha), 0
    while n <= limit:
        good = good + 1 if coverage_probability(n, alpha, 1.0 - alpha - slack) >= probability else 0
        if good > run:
            return n - run
        n += 1
    raise ValueError(f"more than {limit} items would be needed for alpha={alpha}, slack={slack}")


def _rank(n: int, alpha: float) -> int:
    # ceil((n+1)(1-alpha)), so that a product that is an integer in exact arithmetic (10 * 0.9) does not round up
    # by one ulp and then by one rank.
    return math.ceil((n + 1) * (1.0 - alpha) - 1e-9)


def check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be a number in (0, 1); got {alpha!r}")


def conformal_quantile(nonconformity: Sequence[float] | np.ndarray, alpha: float) -> float:
    """The ceil((n+1)(1-alpha))-th smallest of n nonconformity scores (+inf entries allowed).

    Raises CalibrationError when n is too small for alpha (the quantile would be unbounded)."""
    check_alpha(alpha)
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
    conditional_coverage: float | None = None  # among held-out items whose candidates hold a correct chunk


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
    span_tokens: int = 0  # answers of at most this many tokens must occur as a whole span (0: records before the rule)
    n_without_correct: int = 0  # calibration items left out of the quantile: no correct chunk among the candidates
    reranker_backend: str | None = None  # float32 | bfloat16 | int8 the scores were computed in (None: not recorded)
    source: str = ""  # "" : made on this store; else where it was made (the shipped NQ-open default says so)
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
        from certrag.atomic import write_file_atomic

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

    source: str = ""  # the calibration's (Calibration.source)

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "s_thres": self.s_thres, "applied": self.applied, "reason": self.reason,
                "trusted": self.trusted.tolist(), "scores": [float(s) for s in self.scores],
                "calibration": self.source or "this store"}


# ---------------------------------------------------------------------------------------------- diagnostics

@dataclass
class ScoredItems:
    """Per item: the calibrated scores of its candidates (best first) and which are correct."""

    scores: list[np.ndarray] = field(default_factory=list)
    correct: list[np.ndarray] = field(default_factory=list)

    def best_correct(self) -> np.ndarray:
        return np.array([s[c].max() if c.any() else -np.inf for s, c in zip(self.scores, self.correct)])


def threshold(best_correct: np.ndarray, alpha: float) -> float | None:
    """s_thres from the best correct scores of calibration items (-inf where no candidate was correct): the
    split-conformal quantile over the items that have a correct candidate (the misses are left out, see the module
    docstring). None when too few items have one for alpha (the calibration then records that the guarantee does
    not hold)."""
    best = np.asarray(best_correct, dtype=np.float64)
    found = best[np.isfinite(best)]
    if found.size < min_calibration_size(alpha):
        return None
    return -conformal_quantile(-found, alpha)


def diagnose(scored: ScoredItems, s_thres: float | None, alpha: float) -> Diagnostics:
    """The diagnostics of a threshold on held-out items, and the verdict: the guarantee is reported as not holding
    when the threshold is unbounded, or when coverage or m1 falls short of 1 - alpha by more than two binomial
    standard errors (sqrt(alpha (1 - alpha) / n))."""
    n = len(scored.scores)
    reasons = []
    if s_thres is None:
        reasons.append(f"no threshold: too few calibration items have a correct chunk among their candidates for "
                       f"alpha = {alpha} (it needs {min_calibration_size(alpha)}): the retriever does not surface "
                       "correct chunks")
    if n == 0:
        reasons.append("no held-out items to check coverage on")
        return Diagnostics(n_eval=0, coverage=None, m1=None, m2=None, mean_trusted=None, retrieval_recall=None,
                           holds=False, reasons=tuple(reasons))
    trusted = [np.ones(len(s), bool) if s_thres is None else s >= s_thres for s in scored.scores]
    covered = [(t & c).any() for t, c in zip(trusted, scored.correct)]
    coverage = float(np.mean(covered))
    found = [cov for cov, c in zip(covered, scored.correct) if c.any()]
    conditional = float(np.mean(found)) if found else None
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
        reasons.append(f"m1 = {m1:.3f}: too few questions have any trusted chunk (the retriever surfaces a chunk "
                       "that scores like a correct one for only that fraction)")
    return Diagnostics(n_eval=n, coverage=coverage, m1=m1, m2=m2, mean_trusted=mean_trusted,
                       retrieval_recall=recall, holds=not reasons, reasons=tuple(reasons),
                       conditional_coverage=conditional)



def certify(calibration: Calibration | None, retrieval, *, force: bool = False, chunks: int | None = None,
            where: str = "the store", reranker_backend: str | None = None) -> Certification:
    """Marks each candidate of a retrieval (certrag.retrieval.Retrieval) trusted or not under a calibration. applied
    is True when the diagnostics say the guarantee holds (or force): only then should the context shrink to the
    trusted candidates. chunks: the store's size now, to say when it changed since calibration; reranker_backend:
    the numeric backend the reranker runs in now, to say when the calibration's scores were computed in another
    (bfloat16 and float32 scores differ in the third decimal: the threshold is close, the stated coverage is not
    exact)."""
    if calibration is None:
        raise CalibrationError(f"{where} has no calibration: run `certrag calibrate` (or engine.calibrate) first")
    cal = calibration
    scores = calibrated_scores(retrieval.rerank_scores, retrieval.dense_scores, cal.score_transform)
    trusted = cal.trusted(scores)
    stale = (f"; the store has changed since calibration ({cal.chunks:,} -> {chunks:,} chunks): recalibrate"
             if cal.chunks is not None and chunks is not None and cal.chunks != chunks else "")
    if cal.reranker_backend and reranker_backend and cal.reranker_backend != reranker_backend:
        stale += (f"; calibrated with the reranker in {cal.reranker_backend}, which now runs in {reranker_backend}: "
                  f"recalibrate for the stated coverage")
    if cal.source:
        stale += f"; {cal.source}"
    if cal.holds or force:
        return Certification(scores=scores, trusted=trusted, s_thres=cal.s_thres, alpha=cal.alpha, applied=True,
                             reason=(("forced although the guarantee does not hold" if not cal.holds else "")
                                     + stale).lstrip("; "), source=cal.source)
    return Certification(scores=scores, trusted=trusted, s_thres=cal.s_thres, alpha=cal.alpha, applied=False,
                         reason="the guarantee does not hold for this retriever and data: "
                                + "; ".join(cal.diagnostics.reasons) + stale, source=cal.source)
