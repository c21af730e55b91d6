"""Factual confidence of an answer from its lookback ratios, at run time: a logistic regression on the chunk-wise
features, applied with numpy.

Features: the chunk-wise lookback ratio of every (layer, head), averaged over the answer's decode steps
(certrag.certify.lookback). Classifier: standardisation and L2-regularised logistic regression, saved as JSON with
its card (no pickle); the classifiers shipped for the bundled readers live in certrag/certify/models/. How they are
made: certrag.train.factuality (`certrag train-factuality`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class FactualityClassifier:
    model: str  # the LLM whose attention the features come from
    kind: str  # "chunks" or "full"
    layers: int
    heads: int
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    card: dict

    def predict(self, features) -> float:
        """P(answer supported) from a LookbackFeatures; NaN when the answer has no decode steps or no chunks."""
        x = np.asarray(features.vector(self.kind), dtype=np.float64)
        if x.shape != self.mean.shape:
            raise ValueError(f"features have {x.size} values; the classifier expects {self.layers} layers x "
                             f"{self.heads} heads ({self.mean.size})")
        if not np.isfinite(x).all():
            return float("nan")
        return self.predict_vectors(x[None, :])[0]

    def predict_vectors(self, x: np.ndarray) -> np.ndarray:
        z = ((np.asarray(x, dtype=np.float64) - self.mean) / self.scale) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def to_dict(self) -> dict:
        return {"format": "certrag-factuality", "version": 1, "model": self.model, "kind": self.kind,
                "layers": self.layers, "heads": self.heads, "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "coef": self.coef.tolist(), "intercept": self.intercept, "card": self.card}

    def save(self, path: str | Path) -> None:
        from certrag.atomic import write_file_atomic

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> "FactualityClassifier":
        try:
            d = json.loads(Path(path).read_text())
            if d.get("format") != "certrag-factuality":
                raise ValueError("not a certrag factuality classifier")
            return cls(model=d["model"], kind=d["kind"], layers=int(d["layers"]), heads=int(d["heads"]),
                       mean=np.array(d["mean"]), scale=np.array(d["scale"]), coef=np.array(d["coef"]),
                       intercept=float(d["intercept"]), card=d.get("card", {}))
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
