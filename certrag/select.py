"""Context selection: how many of the reranked candidates go to the LLM.

Every selector takes scores sorted best first and returns how many of the leading candidates to keep (at least one
when there is at least one candidate). Each is defined on its own scale, named by its `scale` attribute, and
``cut(selector, raw_scores, kind)`` -- what the engine, the feedback loop and the benchmarks call -- hands it that
scale:

- "positive" (SAGE's gradient rule, whose ratio S[i] > S[i-1] / g needs positive scores): ``positive_scores(...)``,
  for reranker logits exp(s - s_max), each candidate's probability relative to the best under a softmax, so that
  the ratio becomes "the logit dropped by less than ln g" and a constant offset in the logits changes nothing (a
  plain sigmoid saturates at 1 for large logits and hides every drop); for dense cosine scores, (1 + cos) / 2.
- "raw" (top-k, autocut, top-p): the scores as the ranker gave them. Top-p takes a softmax of its input, so it must
  see logits (a softmax of exp(s - max), values in (0, 1], is nearly flat: logits [8, 5, 2, 1, 0, -1] keep 1
  candidate at p = 0.9, their exp(s - max) 6); autocut compares the normalised curve with a straight line, which a
  non-linear map bends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


def positive_scores(scores: np.ndarray, kind: str) -> np.ndarray:
    """Maps raw scores into (0, 1]: exp(s - max s) for logits, (1 + s) / 2 for cosine similarities."""
    s = np.asarray(scores, dtype=np.float64)
    if kind == "logit":
        if s.size == 0:
            return s
        return np.maximum(np.exp(s - np.max(s)), 1e-300)
    if kind == "cosine":
        return np.clip((1.0 + s) / 2.0, 1e-12, 1.0)
    raise ValueError(f"kind must be 'logit' or 'cosine'; got {kind!r}")


def cut(selector: "Selector", scores: np.ndarray, kind: str) -> int:
    """How many of the leading candidates `selector` keeps, given the raw scores sorted best first (kind: "logit"
    for reranker logits, "cosine" for dense similarities), mapped onto the scale the selector is defined on."""
    scale = getattr(selector, "scale", "raw")
    if scale == "positive":
        return selector.select(positive_scores(scores, kind))
    if scale != "raw":
        raise ValueError(f"selector {getattr(selector, 'name', selector)!r} has unknown scale {scale!r}")
    if kind not in ("logit", "cosine"):
        raise ValueError(f"kind must be 'logit' or 'cosine'; got {kind!r}")
    return selector.select(np.asarray(scores, dtype=np.float64))


def _check_sorted(scores: np.ndarray) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if s.size and not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    if s.size > 1 and np.any(np.diff(s) > 1e-12):
        raise ValueError("scores must be sorted best first (non-increasing)")
    return s


class Selector(Protocol):
    name: str
    scale: str  # "positive" or "raw": the scores select() is defined on (see cut)

    def select(self, scores: np.ndarray) -> int: ...


@dataclass(frozen=True, kw_only=True)
class GradientSelector:
    """SAGE's gradient-based selection (Wang et al., 2025, section 3.2).

    Keep the first min_k candidates; then keep candidate i while S[i] > S[i-1] / g, i.e. while the score did not
    drop by more than a factor g from its predecessor; stop at the first sharp drop or at max_k. Scores must be
    positive (see positive_scores).
    """

    min_k: int = 1
    g: float = 1.5
    max_k: int = 10
    name: str = "gradient"
    scale: str = "positive"

    def __post_init__(self) -> None:
        if self.min_k < 1:
            raise ValueError(f"min_k must be at least 1; got {self.min_k}")
        if self.max_k < self.min_k:
            raise ValueError(f"max_k must be at least min_k ({self.min_k}); got {self.max_k}")
        if not self.g > 1.0:
            raise ValueError(f"g must be greater than 1; got {self.g}")

    def select(self, scores: np.ndarray) -> int:
        s = _check_sorted(scores)
        if s.size == 0:
            return 0
        if np.any(s <= 0):
            raise ValueError("gradient selection needs positive scores; map logits with positive_scores()")
        keep = min(self.min_k, s.size)
        while keep < min(self.max_k, s.size) and s[keep] > s[keep - 1] / self.g:
            keep += 1
        return keep


@dataclass(frozen=True, kw_only=True)
class TopKSelector:
    """Fixed top-k: the standard RAG baseline (Lewis et al., 2020)."""

    k: int = 5
    name: str = "topk"
    scale: str = "raw"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be at least 1; got {self.k}")

    def select(self, scores: np.ndarray) -> int:
        return min(self.k, _check_sorted(scores).size)


@dataclass(frozen=True, kw_only=True)
class AutocutSelector:
    """Weaviate's autocut: scores are normalised to [0, 1] between the last and the first and compared with the
    straight line from 1 to 0 over the candidates; a local maximum of the gap (curve minus line) is the last point
    before a jump, and the list is cut right after the `jumps`-th one. A flat curve keeps everything."""

    jumps: int = 1
    max_k: int = 10
    name: str = "autocut"
    scale: str = "raw"

    def __post_init__(self) -> None:
        if self.jumps < 1:
            raise ValueError(f"jumps must be at least 1; got {self.jumps}")
        if self.max_k < 1:
            raise ValueError(f"max_k must be at least 1; got {self.max_k}")

    def select(self, scores: np.ndarray) -> int:
        s = _check_sorted(scores)[: self.max_k]
        n = s.size
        if n <= 1 or s[0] == s[-1]:
            return n
        norm = (s - s[-1]) / (s[0] - s[-1])
        line = 1.0 - np.arange(n) / (n - 1)
        gap = norm - line
        found = 0
        for i in range(1, n):
            left = gap[i] > gap[i - 1]
            right = gap[i] >= gap[i + 1] if i + 1 < n else (n > 2 and gap[i] > gap[i - 2])
            if left and right:
                found += 1
                if found >= self.jumps:
                    return i + 1
        return n


@dataclass(frozen=True, kw_only=True)
class TopPSelector:
    """Nucleus-style cut: softmax over the scores (divided by temperature), then the shortest prefix whose mass
    reaches p (as in top-p sampling, Holtzman et al., 2020, applied to retrieval)."""

    p: float = 0.9
    temperature: float = 1.0
    max_k: int = 10
    name: str = "topp"
    scale: str = "raw"

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p must be in (0, 1]; got {self.p}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive; got {self.temperature}")
        if self.max_k < 1:
            raise ValueError(f"max_k must be at least 1; got {self.max_k}")

    def select(self, scores: np.ndarray) -> int:
        s = _check_sorted(scores)
        if s.size == 0:
            return 0
        z = (s - s[0]) / self.temperature
        w = np.exp(z)
        mass = np.cumsum(w) / w.sum()
        return int(min(self.max_k, np.searchsorted(mass, self.p - 1e-12) + 1))


SELECTORS = {"gradient": GradientSelector, "topk": TopKSelector, "autocut": AutocutSelector, "topp": TopPSelector}


def make_selector(name: str, **params) -> Selector:
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; choose from {sorted(SELECTORS)}")
    return SELECTORS[name](**params)
