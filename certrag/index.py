"""The native HNSW index (Malkov & Yashunin, 2018), with numpy in and out.

Conventions:
- Vectors and queries are float32. float64 input is cast to float32 quietly; any other dtype (integers, float16,
  objects) is refused with a ValueError, so that a wrong array never indexes silently.
- Scores are "higher is better" for every metric: the inner product for ``ip``, the cosine similarity for ``cosine``
  (vectors and queries are normalised on the way in), and the negative squared L2 distance for ``l2``.
- Searching for more results than the index holds returns what it has; missing slots hold id -1 and score -inf.
- ``ef`` is a per-call search breadth, never index state, so differently configured searches can run at once.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from certrag import _core

IndexFormatError = _core.IndexFormatError
IndexIOError = _core.IndexIOError  # an OSError: the file system refused a save or load

METRICS = ("ip", "l2", "cosine")
DEFAULT_EF = 64
MAX_DIM = 65536
MAX_M = 2048
MAX_ID = 2**63 - 1
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SearchResult:
    """Results of a batched search, best first in each row.

    ids: int64 array (n, min(k, live vectors)); -1 where the search found fewer (rare: a graph with many deletions).
    scores: float32 array of the same shape; higher is better; -inf where ids is -1.
    """

    ids: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return self.ids.shape[0]


def _as_matrix(x: object, name: str, dim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    if arr.dtype != np.float32:
        raise ValueError(f"{name} must be float32 (float64 is cast); got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != dim:
        raise ValueError(f"{name} must have shape (n, {dim}) or ({dim},); got {tuple(np.shape(x))}")
    return np.ascontiguousarray(arr)


def _as_ids(x: object, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-d sequence of integers; got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers; got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.unsignedinteger) and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values above the int64 range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _positive_int(value: object, name: str, minimum: int = 1, maximum: int = _INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}; got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}; got {value}")
    return int(value)


class HnswIndex:
    """An HNSW graph over float32 vectors, built and searched on all cores with the GIL released.

    Example::

        >>> import numpy as np, certrag
        >>> index = certrag.HnswIndex(dim=4, metric="cosine")
        >>> ids = index.add(np.eye(4, dtype=np.float32))
        >>> index.search(np.array([[1, 0.1, 0, 0]], dtype=np.float32), k=2).ids[0].tolist()
        [0, 1]

    Thread-safety: searches may run concurrently with each other, with add() and with remove(); save() and an add()
    that must grow storage briefly block the others. See csrc/certrag/hnsw.h for the full contract.
    """

    def __init__(self, dim: int, metric: str = "ip", M: int = 16, ef_construction: int = 200, seed: int = 0,
                 *, _native: _core.HnswIndex | None = None) -> None:
        if _native is not None:
            self._native = _native
            return
        dim = _positive_int(dim, "dim", 1, MAX_DIM)
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}; got {metric!r}")
        M = _positive_int(M, "M", 2, MAX_M)
        ef_construction = _positive_int(ef_construction, "ef_construction")
        seed = _positive_int(seed, "seed", 0, 2**64 - 1)
        self._native = _core.HnswIndex(dim, metric, M, ef_construction, seed)

    @property
    def dim(self) -> int:
        return self._native.dim

    @property
    def metric(self) -> str:
        return self._native.metric

    @property
    def M(self) -> int:
        return self._native.M

    @property
    def ef_construction(self) -> int:
        return self._native.ef_construction

    def __len__(self) -> int:
        return self._native.size()

    def __contains__(self, id: object) -> bool:
        return isinstance(id, (int, np.integer)) and self._native.contains(int(id))

    def __repr__(self) -> str:
        return (f"HnswIndex(dim={self.dim}, metric={self.metric!r}, M={self.M}, "
                f"ef_construction={self.ef_construction}, size={len(self)})")

    def add(self, vectors: object, ids: Iterable[int] | np.ndarray | None = None, num_threads: int = 0) -> np.ndarray:
        """Adds vectors (n, dim) under ids (n,), all-or-nothing; returns the ids as int64.

        Without ids, new ids continue from the largest id ever added (0, 1, 2, ... on a new index). An id that is
        negative, repeated in the batch or already live raises ValueError, as do NaN or inf values, and all-zero
        vectors under the cosine metric; nothing is added then. num_threads=0 uses every core.
        """
        vectors = _as_matrix(vectors, "vectors", self.dim)
        n = vectors.shape[0]
        if ids is None:
            start = self._native.max_label() + 1
            if start > MAX_ID - n + 1:
                raise ValueError(f"ids: automatic ids continue from the largest id ever added ({start - 1}) and would "
                                 f"pass 2**63 - 1; pass ids explicitly")
            ids_arr = np.arange(start, start + n, dtype=np.int64)
        else:
            ids_arr = _as_ids(ids, "ids")
            if ids_arr.shape[0] != n:
                raise ValueError(f"ids must have one entry per vector: got {ids_arr.shape[0]} ids for {n} vectors")
        num_threads = _positive_int(num_threads, "num_threads", 0)
        self._native.add(vectors, ids_arr, num_threads)
        return ids_arr

    def search(self, queries: object, k: int, ef: int | None = None, num_threads: int = 0) -> SearchResult:
        """Returns the k best ids and scores for each query row (a 1-d query counts as one row): min(k, len(self))
        columns, so a k above the index's size costs nothing.

        ef is the breadth of the search (default max(k, 64)); larger is slower and more exact.
        """
        # The common case (a C-contiguous float32 matrix, plain ints) skips the conversions: on a single query they
        # would cost a third of the search itself. The binding still checks the shape.
        if not (type(queries) is np.ndarray and queries.dtype == np.float32 and queries.ndim == 2
                and queries.flags.c_contiguous):
            queries = _as_matrix(queries, "queries", self.dim)
        if type(k) is not int or not 1 <= k <= _INT32_MAX:
            k = _positive_int(k, "k")
        if ef is None:
            ef = k if k > DEFAULT_EF else DEFAULT_EF
        elif type(ef) is not int or not 1 <= ef <= _INT32_MAX:
            ef = _positive_int(ef, "ef")
        if type(num_threads) is not int or not 0 <= num_threads <= _INT32_MAX:
            num_threads = _positive_int(num_threads, "num_threads", 0)
        ids, scores = self._native.search(queries, k, ef, num_threads)
        return SearchResult(ids=ids, scores=scores)

    def remove(self, ids: Iterable[int] | np.ndarray) -> int:
        """Marks ids deleted so that searches no longer return them; returns how many were present."""
        return self._native.remove(_as_ids(ids, "ids"))

    def get_vectors(self, ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """The stored vectors (normalised under the cosine metric) of live ids, as float32 (n, dim)."""
        return self._native.get_vectors(_as_ids(ids, "ids"))

    def ids(self) -> np.ndarray:
        """Live ids in insertion order."""
        return self._native.labels()

    def stats(self) -> dict:
        """Graph shape and memory: nodes, live, deleted, max_level, nodes_per_level, mean_degree_level0, ..."""
        stats = dict(self._native.stats())
        stats.update(dim=self.dim, metric=self.metric, M=self.M, ef_construction=self.ef_construction)
        return stats

    def save(self, path: str | os.PathLike) -> None:
        """Writes the index atomically (temporary file, fsync, rename): a crash leaves the old file intact. A file
        system that refuses raises IndexIOError (an OSError)."""
        self._native.save(os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, mmap: bool = False) -> "HnswIndex":
        """Loads and fully validates an index file; raises IndexFormatError (a ValueError) on a bad file.

        With mmap=True the vectors and level-0 links are mapped read-only from the file instead of copied; the
        first add() copies them into memory.
        """
        path = os.fspath(path)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:  # also when a writer replaced its version meanwhile: the store reader retries
            raise FileNotFoundError(f"no index file at {path}") from None
        if not stat.S_ISREG(mode):  # a folder, a FIFO or a device: refused before anything opens it
            raise IndexFormatError(f"{path} is not a regular file")
        return cls(0, _native=_core.HnswIndex.load(path, bool(mmap)))
