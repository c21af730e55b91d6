"""P(correct) of an answer, at run time: a logistic regression on the answer's lookback ratios, optionally stacked
with its mean token log-probability, or the log-probability alone, calibrated; applied with numpy.

What it predicts is what it was trained on (LABEL): that the answer contains a reference answer (NQ-open's gold
answers, DPR-normalised, contained in the normalised answer), hence the field's name, `p_correct`. Features: the
chunk-wise or full-context lookback ratio of every (layer, head), averaged over the answer's decode steps
(certrag.certify.lookback); the answer's mean token log-probability. Kinds:
- "chunks" / "full": standardisation and L2-regularised logistic regression on the ratios;
- the same with `stack`: the ratios model's decision value and the mean log-probability joined by a second,
  two-feature logistic regression (Lookback Lens's features with the free baseline kept at its own weight);
- "logprob": a logistic regression on the mean log-probability alone (the calibrated free baseline: what ships
  where no lookback model beats it).
Saved as JSON with its card (no pickle); the classifiers shipped for the bundled readers live in
certrag/certify/models/. How they are made: certrag.train.factuality and `benchmarks/bench_factuality.py --ship`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parent / "models"
LABEL = "P(correct): the probability that the answer contains a reference answer (NQ-open gold answer contained)"
KINDS = ("chunks", "full", "logprob")


@dataclass(frozen=True)
class Stack:
    """The second level of a stacked classifier: logistic regression on [first-level decision value, mean
    log-probability], each standardised."""
    mean: np.ndarray  # (2,)
    scale: np.ndarray  # (2,)
    coef: np.ndarray  # (2,)
    intercept: float

    def to_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept}

    @classmethod
    def from_dict(cls, d: dict) -> "Stack":
        out = cls(mean=np.array(d["mean"], dtype=np.float64), scale=np.array(d["scale"], dtype=np.float64),
                  coef=np.array(d["coef"], dtype=np.float64), intercept=float(d["intercept"]))
        if not out.mean.shape == out.scale.shape == out.coef.shape == (2,):
            raise ValueError("a stack has two inputs")
        return out


@dataclass(frozen=True)
class FactualityClassifier:
    model: str  # the LLM whose answers (and attention) the features come from
    kind: str  # "chunks", "full" or "logprob"
    layers: int
    heads: int
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    card: dict
    stack: Stack | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if self.kind == "logprob" and self.stack is not None:
            raise ValueError("a log-probability classifier has no stack")

    @property
    def needs_lookback(self) -> bool:
        """Whether the answer must be generated recording lookback ratios."""
        return self.kind != "logprob"

    def predict(self, features, mean_logprob: float = math.nan) -> float:
        """P(correct) from a LookbackFeatures (None for a "logprob" classifier) and the answer's mean token
        log-probability (used by "logprob" and stacked classifiers); NaN when an input it needs is missing (no
        decode steps, no chunks, no log-probability)."""
        lp = np.array([mean_logprob], dtype=np.float64)
        if self.kind == "logprob":
            return float(self.predict_vectors(lp[:, None])[0]) if np.isfinite(lp).all() else math.nan
        if features is None:
            return math.nan
        x = np.asarray(features.vector(self.kind), dtype=np.float64)
        if x.shape != self.mean.shape:
            raise ValueError(f"features have {x.size} values; the classifier expects {self.layers} layers x "
                             f"{self.heads} heads ({self.mean.size})")
        if not np.isfinite(x).all() or (self.stack is not None and not np.isfinite(lp).all()):
            return math.nan
        return float(self.predict_vectors(x[None, :], lp)[0])

    def decision(self, x: np.ndarray) -> np.ndarray:
        """The first level's decision value (log-odds) for rows of features."""
        return ((np.asarray(x, dtype=np.float64) - self.mean) / self.scale) @ self.coef + self.intercept

    def predict_vectors(self, x: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        """P(correct) for rows of features; extra: the rows' mean log-probabilities (stacked classifiers)."""
        z = self.decision(x)
        if self.stack is not None:
            if extra is None:
                raise ValueError("a stacked classifier needs the mean log-probabilities (extra)")
            st = self.stack
            second = (np.column_stack([z, np.asarray(extra, dtype=np.float64)]) - st.mean) / st.scale
            z = second @ st.coef + st.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def to_dict(self) -> dict:
        return {"format": "certrag-factuality", "version": 2, "model": self.model, "kind": self.kind,
                "label": LABEL, "layers": self.layers, "heads": self.heads, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "coef": self.coef.tolist(), "intercept": self.intercept,
                "stack": self.stack.to_dict() if self.stack is not None else None, "card": self.card}

    def save(self, path: str | Path) -> None:
        from certrag.atomic import write_file_atomic

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> "FactualityClassifier":
        try:
            d = json.loads(Path(path).read_text())
            if d.get("format") != "certrag-factuality" or d.get("version") not in (1, 2):
                raise ValueError("not a certrag factuality classifier of version 1 or 2")
            return cls(model=d["model"], kind=d["kind"], layers=int(d["layers"]), heads=int(d["heads"]),
                       mean=np.array(d["mean"]), scale=np.array(d["scale"]), coef=np.array(d["coef"]),
                       intercept=float(d["intercept"]), card=d.get("card", {}),
                       stack=Stack.from_dict(d["stack"]) if d.get("stack") else None)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: cannot load the factuality classifier ({exc})") from None

    @classmethod
    def for_model(cls, model: str) -> "FactualityClassifier":
        """The classifier shipped in the package for a bundled model (read once per process and model)."""
        return _shipped(cls, model)


@lru_cache(maxsize=16)
def _shipped(cls, model: str) -> FactualityClassifier:
    path = PACKAGE_DIR / f"{model}.json"
    if not path.exists():
        raise FileNotFoundError(f"no factuality classifier ships for {model!r}; train one with "
                                f"`certrag train-factuality --model {model}`")
    return cls.load(path)


def has_classifier(model: str) -> bool:
    """Whether a factuality classifier ships in the package for the model."""
    return (PACKAGE_DIR / f"{model}.json").exists()
