"""A fingerprint of single-threaded HNSW builds and searches (ids and scores, every metric), to check that a change
to the native core leaves results bit for bit as they were. Run it against two builds and compare the lines:

    git worktree add ../before <commit> && (cd ../before && python setup.py build_ext --inplace)
    PYTHONPATH=../before python benchmarks/index_fingerprint.py
    python benchmarks/index_fingerprint.py
"""

from __future__ import annotations

import hashlib

import certrag

try:
    from certrag.data.vectors import clustered_vectors
except ImportError:  # builds from before the data/ room
    from certrag.datasets import clustered_vectors


def main() -> None:
    base, queries = clustered_vectors(20_000, 384, n_queries=300, seed=0)
    h = hashlib.sha256()
    for metric in ("cosine", "ip", "l2"):
        index = certrag.HnswIndex(dim=384, metric=metric, M=16, ef_construction=100, seed=0)
        index.add(base, num_threads=1)
        r = index.search(queries, k=10, ef=64, num_threads=1)
        h.update(r.ids.tobytes())
        h.update(r.scores.tobytes())
    print(f"{certrag.__file__}: {h.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
