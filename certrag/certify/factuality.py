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
  where no lookback model beats it);
- "signals": a logistic regression on free per-answer signals (answer_signals: the answer's mean, minimum and first
  token log-probability, the best fused reranker score of its passages, the share of its words found in one of
  its passages), no lookback ratios.
A stack's second level may join more of those signals than the mean log-probability (Stack.inputs).
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

from certrag.textnorm import normalize_answer

PACKAGE_DIR = Path(__file__).resolve().parent / "models"
LABEL = "P(correct): the probability that the answer contains a reference answer (NQ-open gold answer contained)"
KINDS = ("chunks", "full", "logprob", "signals")
SIGNALS = ("mean_logprob", "min_logprob", "first_logprob", "top_rerank", "support")


def answer_support(answer: str, passages) -> float:
    """The largest share of the answer's words (DPR-normalised, as the label compares them) found in one of the
    passages it was given: 1.0 for a span copied from a passage, near 0 for an invented answer or an "unknown";
    0.0 for an answer with no words. Free: no model, the answer's text and the passages only."""
    words = normalize_answer(answer).split()
    if not words:
        return 0.0
    best = 0
    for passage in passages:
        vocabulary = set(normalize_answer(passage).split())
        best = max(best, sum(w in vocabulary for w in words))
    return best / len(words)


def answer_signals(token_logprobs, passage_scores=(), *, answer: str | None = None,
                   passages=None) -> dict[str, float]:
    """The free signals of one answer, the same at training and at run time: its mean, minimum and first token
    log-probability, the best fused reranker score among the passages it was given, and its support in them
    (answer_support; needs the answer's text and the passages). NaN where missing: no generated tokens, passages
    not reranked, no text or passages given."""
    lp = [float(v) for v in token_logprobs]
    scores = np.asarray(passage_scores, dtype=np.float64).ravel()
    scores = scores[np.isfinite(scores)]
    support = answer_support(answer, passages) if answer is not None and passages is not None else math.nan
    return {"mean_logprob": sum(lp) / len(lp) if lp else math.nan, "min_logprob": min(lp) if lp else math.nan,
            "first_logprob": lp[0] if lp else math.nan,
            "top_rerank": float(scores.max()) if scores.size else math.nan, "support": support}


SIGNAL_NAMES = {"mean_logprob": "the mean token log-probability", "min_logprob": "the minimum token log-probability",
                "first_logprob": "the first token's log-probability",
                "top_rerank": "the best fused reranker score of the passages",
                "support": "the share of the answer's words found in one of its passages"}


def describe_signals(names) -> str:
    return ", ".join(SIGNAL_NAMES[n] for n in names)


def _signal_row(signals: dict, names) -> np.ndarray:
    return np.array([float(signals.get(n, math.nan)) for n in names], dtype=np.float64)


@dataclass(frozen=True)
class Stack:
    """The second level of a stacked classifier: logistic regression on [first-level decision value, the answer's
    free signals named by inputs (SIGNALS; before version 3 always the mean log-probability alone)], each
    standardised."""
    mean: np.ndarray  # (1 + len(inputs),)
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    inputs: tuple[str, ...] = ("mean_logprob",)

    def __post_init__(self) -> None:
        unknown = [n for n in self.inputs if n not in SIGNALS]
        if unknown or not self.inputs:
            raise ValueError(f"a stack's inputs must be some of {SIGNALS}; got {self.inputs}")
        if not self.mean.shape == self.scale.shape == self.coef.shape == (1 + len(self.inputs),):
            raise ValueError(f"a stack over {len(self.inputs)} signals has {1 + len(self.inputs)} inputs")

    def to_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept, "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, d: dict) -> "Stack":
        return cls(mean=np.array(d["mean"], dtype=np.float64), scale=np.array(d["scale"], dtype=np.float64),
                   coef=np.array(d["coef"], dtype=np.float64), intercept=float(d["intercept"]),
                   inputs=tuple(d.get("inputs", ("mean_logprob",))))


@dataclass(frozen=True)
class FactualityClassifier:
    model: str  # the LLM whose answers (and attention) the features come from
    kind: str  # "chunks", "full", "logprob" or "signals"
    layers: int
    heads: int
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    card: dict
    stack: Stack | None = None
    inputs: tuple[str, ...] = ()  # a "signals" classifier's features, some of SIGNALS ("logprob": mean_logprob)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if self.kind in ("logprob", "signals") and self.stack is not None:
            raise ValueError(f"a {self.kind!r} classifier has no stack")
        if self.kind == "signals" and (not self.inputs or any(n not in SIGNALS for n in self.inputs)
                                       or self.mean.shape != (len(self.inputs),)):
            raise ValueError(f"a 'signals' classifier's inputs must be some of {SIGNALS}, one weight each; got "
                             f"{self.inputs} with {self.mean.size} weights")
        if self.kind != "signals" and self.inputs:
            raise ValueError("only a 'signals' classifier names its inputs")

    @property
    def needs_lookback(self) -> bool:
        """Whether the answer must be generated recording lookback ratios."""
        return self.kind not in ("logprob", "signals")

    @property
    def signals(self) -> tuple[str, ...]:
        """The free signals (SIGNALS) the classifier reads besides the lookback ratios."""
        if self.kind == "logprob":
            return ("mean_logprob",)
        if self.kind == "signals":
            return self.inputs
        return self.stack.inputs if self.stack is not None else ()

    @property
    def score_name(self) -> str:
        """A short name of what it reads: "logprob", "signals", "full", "full+logprob" (a stack over the mean
        log-probability), "full+signals" (over more free signals)."""
        if self.stack is None:
            return self.kind
        return f"{self.kind}+{'logprob' if self.stack.inputs == ('mean_logprob',) else 'signals'}"

    def describe(self) -> str:
        """What it reads, in words."""
        if self.kind == "logprob":
            return "calibrated mean log-probability"
        if self.kind == "signals":
            return f"logistic regression on {describe_signals(self.inputs)}"
        ratios = f"{'chunk-wise' if self.kind == 'chunks' else 'full-context'} lookback ratios"
        return ratios if self.stack is None else f"stacked {ratios} + {describe_signals(self.stack.inputs)}"

    def predict(self, features, mean_logprob: float = math.nan, *, signals: dict | None = None) -> float:
        """P(correct) from a LookbackFeatures (None for a "logprob" or "signals" classifier) and the answer's free
        signals (answer_signals; mean_logprob, when given, is the mean token log-probability); NaN when an input
        it needs is missing (no decode steps, no chunks, no log-probability, passages not reranked)."""
        signals = dict(signals or {})
        if not math.isnan(mean_logprob):
            signals["mean_logprob"] = mean_logprob
        extra = _signal_row(signals, self.signals)
        if not np.isfinite(extra).all():
            return math.nan
        if not self.needs_lookback:
            return float(self.predict_vectors(extra[None, :])[0])
        if features is None:
            return math.nan
        x = np.asarray(features.vector(self.kind), dtype=np.float64)
        if x.shape != self.mean.shape:
            raise ValueError(f"features have {x.size} values; the classifier expects {self.layers} layers x "
                             f"{self.heads} heads ({self.mean.size})")
        if not np.isfinite(x).all():
            return math.nan
        return float(self.predict_vectors(x[None, :], extra[None, :] if self.stack is not None else None)[0])

    def decision(self, x: np.ndarray) -> np.ndarray:
        """The first level's decision value (log-odds) for rows of features."""
        return ((np.asarray(x, dtype=np.float64) - self.mean) / self.scale) @ self.coef + self.intercept

    def predict_vectors(self, x: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        """P(correct) for rows of features; extra: the rows' signals in the stack's input order, (rows,) or (rows,
        inputs) (stacked classifiers; a version-2 stack's is the mean log-probability)."""
        z = self.decision(x)
        if self.stack is not None:
            if extra is None:
                raise ValueError(f"a stacked classifier needs the rows' {', '.join(self.stack.inputs)} (extra)")
            st = self.stack
            extra = np.asarray(extra, dtype=np.float64).reshape(len(z), -1)
            if extra.shape[1] != len(st.inputs):
                raise ValueError(f"extra has {extra.shape[1]} columns; the stack reads {st.inputs}")
            second = (np.column_stack([z, extra]) - st.mean) / st.scale
            z = second @ st.coef + st.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def to_dict(self) -> dict:
        return {"format": "certrag-factuality", "version": 3, "model": self.model, "kind": self.kind,
                "inputs": list(self.inputs),
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
            if d.get("format") != "certrag-factuality" or d.get("version") not in (1, 2, 3):
                raise ValueError("not a certrag factuality classifier of version 1 to 3")
            return cls(model=d["model"], kind=d["kind"], layers=int(d["layers"]), heads=int(d["heads"]),
                       mean=np.array(d["mean"]), scale=np.array(d["scale"]), coef=np.array(d["coef"]),
                       intercept=float(d["intercept"]), card=d.get("card", {}),
                       stack=Stack.from_dict(d["stack"]) if d.get("stack") else None,
                       inputs=tuple(d.get("inputs", ())))
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
