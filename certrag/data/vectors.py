"""Synthetic vectors shaped like sentence embeddings, for tests and benchmarks of the index.

Uniform random vectors are useless for judging an ANN index (in 384 dimensions every point is nearly equidistant
from every other, and every library stalls near recall 0.4), so these are clustered, low in intrinsic dimension and
anisotropic, as real sentence embeddings are: cluster centres and within-cluster offsets live in a small latent space,
are projected to ``dim`` dimensions, get a shared mean direction and a little full-rank noise, and are normalised.
"""

from __future__ import annotations

import numpy as np


def clustered_vectors(n: int, dim: int = 384, *, n_queries: int = 0, latent_dim: int = 48, clusters: int | None = None,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Returns (base (n, dim), queries (n_queries, dim)), both float32 with unit rows, drawn from one distribution."""
    if n < 0 or n_queries < 0:
        raise ValueError("n and n_queries must be >= 0")
    rng = np.random.default_rng(seed)
    latent_dim = min(latent_dim, dim)
    clusters = clusters or max(1, (n + n_queries) // 100)
    projection = rng.standard_normal((latent_dim, dim)).astype(np.float32) / np.sqrt(latent_dim)
    mean_direction = rng.standard_normal(dim).astype(np.float32)
    mean_direction *= 0.6 / np.linalg.norm(mean_direction)
    centres = rng.standard_normal((clusters, latent_dim)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        which = rng.integers(0, clusters, size=m)
        latent = centres[which] + 0.55 * rng.standard_normal((m, latent_dim)).astype(np.float32)
        x = latent @ projection
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        x += mean_direction + 0.08 * rng.standard_normal((m, dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x.astype(np.float32)

    return draw(n), draw(n_queries)


def exact_search(base: np.ndarray, queries: np.ndarray, k: int, metric: str = "ip") -> tuple[np.ndarray, np.ndarray]:
    """Brute-force top-k (ids, scores) with certrag's score convention: the oracle for recall."""
    if metric == "cosine":
        base = base / np.linalg.norm(base, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    if metric == "l2":
        scores = -(np.sum(queries**2, axis=1)[:, None] - 2 * queries @ base.T + np.sum(base**2, axis=1)[None, :])
    else:
        scores = queries @ base.T
    k = min(k, base.shape[0])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    part_scores = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-part_scores, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1).astype(np.int64), np.take_along_axis(part_scores, order, axis=1)


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of truth found in the same row of found."""
    k = truth.shape[1]
    hits = sum(len(set(f[:k].tolist()) & set(t.tolist())) for f, t in zip(found, truth))
    return hits / truth.size
