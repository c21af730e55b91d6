"""SAGE's segmentation head: p(two adjacent sentences belong to one chunk).

    p(x1, x2) = sigmoid(w2 . relu(W1 [x1, x2, x1 - x2, x1 * x2] + b1) + b2)

over the sentence embeddings x1, x2 (DESIGN.md). Weights live in a safetensors file (w1 (H, 4d), b1 (H,), w2 (H,),
b2 (1,)) with a JSON card beside it (same name, ``.json``): training data, steps, held-out metrics, embedder name and
dimension. Scoring runs on the native fused scorer (csrc/certrag/pair_scorer.h) by default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from certrag import _core
from certrag.atomic import write_file_atomic

PACKAGE_HEAD = Path(__file__).resolve().parent / "data" / "head.safetensors"


class SegmenterHead:
    def __init__(self, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: float, card: dict | None = None) -> None:
        w1 = np.ascontiguousarray(w1, dtype=np.float32)
        b1 = np.ascontiguousarray(b1, dtype=np.float32).reshape(-1)
        w2 = np.ascontiguousarray(w2, dtype=np.float32).reshape(-1)
        if w1.ndim != 2 or w1.shape[1] % 4 != 0 or w1.shape[1] == 0:
            raise ValueError(f"w1 must have shape (hidden, 4 * dim); got {w1.shape}")
        if b1.shape != (w1.shape[0],) or w2.shape != (w1.shape[0],):
            raise ValueError(f"b1 and w2 must have shape ({w1.shape[0]},); got {b1.shape} and {w2.shape}")
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, float(np.float32(b2))
        self.card = dict(card or {})
        self.path: Path | None = None  # the file it was loaded from (load() sets it)
        self._scorers: dict[str, _core.PairScorer] = {}

    @property
    def embedder_dir(self) -> Path | None:
        """The folder of the encoder this head was fine-tuned with (the card's "embedder_dir", beside the head's
        file), or None for a head trained on the frozen bundled embedder."""
        name = self.card.get("embedder_dir")
        if not name:
            return None
        if self.path is None:
            raise ValueError("this head names a fine-tuned embedder but was not loaded from a file")
        return self.path.parent / name

    def own_embedder(self):
        """The fine-tuned Embedder this head was trained with, or None (then any embedder of its dimension)."""
        folder = self.embedder_dir
        if folder is None:
            return None
        from certrag.embed import Embedder

        return Embedder(model_dir=folder, name=self.card.get("embedder", folder.name))

    @property
    def dim(self) -> int:
        return self.w1.shape[1] // 4

    @property
    def hidden(self) -> int:
        return self.w1.shape[0]

    @classmethod
    def random(cls, dim: int, hidden: int, seed: int = 0) -> "SegmenterHead":
        """Random weights with the initialisation scale of torch.nn.Linear (for tests and as a training start)."""
        rng = np.random.default_rng(seed)
        a1, a2 = 1 / np.sqrt(4 * dim), 1 / np.sqrt(hidden)
        return cls(rng.uniform(-a1, a1, (hidden, 4 * dim)), rng.uniform(-a1, a1, hidden),
                   rng.uniform(-a2, a2, hidden), float(rng.uniform(-a2, a2)), {"kind": "random", "seed": seed})

    @classmethod
    def default(cls) -> "SegmenterHead":
        """The head trained by certrag and shipped in the package (see its card)."""
        if not PACKAGE_HEAD.exists():
            raise FileNotFoundError(f"the packaged segmenter head is missing at {PACKAGE_HEAD}; rebuild it with "
                                    "`certrag train-segmenter --out certrag/segment/data/head.safetensors`")
        return cls.load(PACKAGE_HEAD)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SegmenterHead":
        from safetensors.numpy import load_file

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no segmenter head at {path}")
        tensors = load_file(str(path))
        missing = {"w1", "b1", "w2", "b2"} - set(tensors)
        if missing:
            raise ValueError(f"{path} is not a segmenter head: missing tensors {sorted(missing)}")
        card_path = path.with_suffix(".json")
        card = json.loads(card_path.read_text()) if card_path.exists() else {}
        head = cls(tensors["w1"], tensors["b1"], tensors["w2"], float(tensors["b2"].reshape(-1)[0]), card)
        head.path = path
        return head

    def save(self, path: str | os.PathLike) -> None:
        """Writes the weights and the card, each atomically."""
        from safetensors.numpy import save

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = save({"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": np.array([self.b2], dtype=np.float32)},
                    metadata={"format": "certrag-segmenter-head", "dim": str(self.dim), "hidden": str(self.hidden)})
        write_file_atomic(path, data)
        write_file_atomic(path.with_suffix(".json"), (json.dumps(self.card, indent=2) + "\n").encode())
        self.path = path

    def scorer(self, level: str = "auto", precision: str = "float32") -> _core.PairScorer:
        key = (level, precision)
        if key not in self._scorers:
            self._scorers[key] = _core.PairScorer(self.w1, self.b1, self.w2, self.b2, level, precision)
        return self._scorers[key]

    def score_adjacent(self, embeddings: np.ndarray, num_threads: int = 0, level: str = "auto",
                       precision: str = "float32") -> np.ndarray:
        """p(same chunk) for each adjacent pair of rows: float32 (n - 1,), on the native fused scorer.

        precision="bfloat16" (CPUs with AVX512_BF16) is faster at an error of order 1e-2 in probability.
        """
        embeddings = np.asarray(embeddings)
        if embeddings.dtype == np.float64:
            embeddings = embeddings.astype(np.float32)
        if embeddings.ndim != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must have shape (n, {self.dim}); got {embeddings.shape}")
        return self.scorer(level, precision).score_adjacent(np.ascontiguousarray(embeddings, dtype=np.float32),
                                                            num_threads)

    def score_adjacent_pairs(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """p(same chunk) for arbitrary pairs (left[i], right[i]), computed as adjacent pairs of an interleaved
        array so that the native scorer serves this case too; returns (n,)."""
        left, right = np.asarray(left, dtype=np.float32), np.asarray(right, dtype=np.float32)
        if left.shape != right.shape:
            raise ValueError(f"left and right must have the same shape; got {left.shape} and {right.shape}")
        both = np.empty((2 * len(left), self.dim), dtype=np.float32)
        both[0::2], both[1::2] = left, right
        return self.score_adjacent(both)[0::2]

    def score_reference(self, embeddings: np.ndarray) -> np.ndarray:
        """The unfused MLP in float64 numpy: an independent check of the native scorer."""
        x = np.asarray(embeddings, dtype=np.float64)
        a, b = x[:-1], x[1:]
        feats = np.concatenate([a, b, a - b, a * b], axis=1)
        hidden = np.maximum(feats @ self.w1.astype(np.float64).T + self.b1, 0.0)
        return 1.0 / (1.0 + np.exp(-(hidden @ self.w2.astype(np.float64) + self.b2)))
