"""A store split into N HNSW shards by a stable hash of the document id, searched by scatter-gather.

A document's chunks all live in one shard (shard_of(doc_id, n)), so add and remove touch one shard each and an
index larger than one machine's memory can be served by several processes (certrag.scale.shards runs one Ray actor
per shard). A search asks every shard for its own top k at the same ef and merges them: the merged top k is exact
with respect to the shards' answers, and each shard, being a smaller graph searched as deeply, finds its own
neighbours at least as well as the unsharded index finds them (recall is measured in bench_scale).

ShardedIndex has HnswIndex's reading interface (search, len, dim, metric, get_vectors, ids, stats), so the retrieval
stage runs on it unchanged; add() also takes the document id of each row, to route it. RayShardedIndex has the same
reading interface over one Ray actor per shard (Engine.open(store, read_only=True, shard_actors=True), after
certrag.scale.connect): each actor maps its shard's file, and a query batch is scattered to all of them and their
top k merged. The shard files must be readable where the actors run (a shared file system on a multi-node
cluster); a store served this way is read-only.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from certrag.index import HnswIndex, SearchResult

MAX_SHARDS = 1024


def shard_of(doc_id: str, n: int) -> int:
    """The shard (0..n-1) of a document: the first 8 bytes of SHA-256(doc_id), big-endian, modulo n. Stable across
    processes, machines and Python versions (str hash() is salted per process, so it cannot be used)."""
    if n == 1:
        return 0
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") % n


def check_shards(n: object, name: str = "shards") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_SHARDS}; got {n!r}")
    return int(n)


def merge_top_k(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int) -> SearchResult:
    """The k best (id, score) of each query row over the shards' answers (each (n, k_i) ids and scores, best
    first, -1 / -inf padding): min(k, sum k_i) columns, as HnswIndex.search sizes its own. Ties keep the lower shard
    first, so a merge is deterministic."""
    ids = np.concatenate([p[0] for p in parts], axis=1)
    scores = np.concatenate([p[1] for p in parts], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    ids, scores = np.take_along_axis(ids, order, axis=1), np.take_along_axis(scores, order, axis=1)
    return SearchResult(ids=np.ascontiguousarray(ids), scores=np.ascontiguousarray(scores, dtype=np.float32))


class ShardedIndex:
    """N HnswIndex shards in this process, searched in parallel threads (the native search releases the GIL).

    Thread-safety: as HnswIndex's, shard by shard; a search sees each shard as it is at the moment it reaches it.
    """

    def __init__(self, shards: Sequence[HnswIndex]) -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("a ShardedIndex needs at least one shard")
        first = shards[0]
        for i, s in enumerate(shards[1:], 1):
            if (s.dim, s.metric) != (first.dim, first.metric):
                raise ValueError(f"shard {i} is {s.dim}-d {s.metric}; shard 0 is {first.dim}-d {first.metric}")
        self.shards = shards
        self._pool = ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="certrag-shard") \
            if len(shards) > 1 else None

    @classmethod
    def empty(cls, n: int, dim: int, metric: str = "ip", M: int = 16, ef_construction: int = 200) -> "ShardedIndex":
        return cls([HnswIndex(dim, metric, M, ef_construction, seed=i) for i in range(check_shards(n))])

    @property
    def dim(self) -> int:
        return self.shards[0].dim

    @property
    def metric(self) -> str:
        return self.shards[0].metric

    @property
    def M(self) -> int:
        return self.shards[0].M

    @property
    def ef_construction(self) -> int:
        return self.shards[0].ef_construction

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def __contains__(self, id: object) -> bool:
        return any(id in s for s in self.shards)

    def __repr__(self) -> str:
        return f"ShardedIndex(shards={len(self.shards)}, dim={self.dim}, metric={self.metric!r}, size={len(self)})"

    def add(self, vectors: np.ndarray, ids: np.ndarray, doc_ids: Sequence[str], num_threads: int = 0) -> np.ndarray:
        """Adds each row to the shard of its document (doc_ids[i]); ids are required. Ids already live in any shard
        are refused before anything is added; a shard that refuses its rows (NaN values) leaves the shards before it
        changed, so after an error the caller re-reads the store (the engine does)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(doc_ids) != len(ids):
            raise ValueError(f"doc_ids must have one entry per vector: got {len(doc_ids)} for {len(ids)} vectors")
        live = [int(i) for i in ids if i in self]
        if live:
            raise ValueError(f"ids already in the index: {live[:5]}")
        target = np.array([shard_of(d, len(self.shards)) for d in doc_ids], dtype=np.int64)
        for s, shard in enumerate(self.shards):
            rows = np.flatnonzero(target == s)
            if len(rows):
                shard.add(np.asarray(vectors)[rows], ids[rows], num_threads=num_threads)
        return ids

    def search(self, queries: np.ndarray, k: int, ef: int | None = None, num_threads: int = 0) -> SearchResult:
        """Every shard's top k at this ef, merged (merge_top_k)."""
        if self._pool is None:
            return self.shards[0].search(queries, k, ef, num_threads)
        futures = [self._pool.submit(s.search, queries, k, ef, num_threads) for s in self.shards]
        results = [f.result() for f in futures]
        return merge_top_k([(r.ids, r.scores) for r in results], k)

    def remove(self, ids) -> int:
        return sum(s.remove(ids) for s in self.shards)

    def get_vectors(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        missing = [int(i) for i in ids if i not in self]
        if missing:
            raise ValueError(f"ids not in the index: {missing[:5]}")
        out = np.zeros((len(ids), self.dim), np.float32)
        for s in self.shards:
            mine = np.array([int(i) in s for i in ids], dtype=bool)
            if mine.any():
                out[mine] = s.get_vectors(ids[mine])
        return out

    def ids(self) -> np.ndarray:
        return np.concatenate([s.ids() for s in self.shards])

    def stats(self) -> dict:
        per = [s.stats() for s in self.shards]
        out = {"shards": len(per), "nodes": sum(p["nodes"] for p in per), "live": sum(p["live"] for p in per),
               "deleted": sum(p["deleted"] for p in per), "per_shard": [{"live": p["live"]} for p in per],
               "dim": self.dim, "metric": self.metric, "M": self.M, "ef_construction": self.ef_construction}
        out["memory_bytes"] = sum(p.get("memory_bytes", 0) for p in per)
        out["max_level"] = max(p.get("max_level", 0) for p in per)
        out["mmapped"] = all(p.get("mmapped", False) for p in per)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class ShardActor:
    """One shard: its HnswIndex, mapped from the store's file."""

    def __init__(self, path: str, mmap: bool = True) -> None:
        self.index = HnswIndex.load(path, mmap=mmap)

    def search(self, queries: np.ndarray, k: int, ef: int | None) -> tuple[np.ndarray, np.ndarray]:
        r = self.index.search(queries, k, ef)
        return r.ids, r.scores

    def describe(self) -> dict:
        return {"size": len(self.index), "dim": self.index.dim, "metric": self.index.metric, "M": self.index.M,
                "ef_construction": self.index.ef_construction, "stats": self.index.stats()}

    def get_vectors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mine = np.array([int(i) in self.index for i in ids], dtype=bool)
        return mine, self.index.get_vectors(ids[mine]) if mine.any() else np.zeros((0, self.index.dim), np.float32)


class RayShardedIndex:
    """The reading interface of HnswIndex (search, len, dim, metric, get_vectors, stats) over shard actors."""

    def __init__(self, paths: Sequence[Path], expected_sizes: Sequence[int] | None = None, *,
                 num_cpus: float = 0) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError("shard actors need Ray: pip install 'certrag[ray]'") from None
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call certrag.scale.connect(address) first")
        self._ray = ray
        remote = ray.remote(ShardActor).options(num_cpus=num_cpus, max_restarts=-1, max_task_retries=-1)
        self.actors = [remote.remote(str(p)) for p in paths]
        self._info = ray.get([a.describe.remote() for a in self.actors])
        sizes = [i["size"] for i in self._info]
        if expected_sizes is not None and list(expected_sizes) != sizes:
            raise ValueError(f"the shard actors hold {sizes} vectors; the manifest says {list(expected_sizes)}")
        first = self._info[0]
        self.dim, self.metric, self.M, self.ef_construction = (first["dim"], first["metric"], first["M"],
                                                               first["ef_construction"])
        self._size = sum(sizes)

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"RayShardedIndex(shards={len(self.actors)}, dim={self.dim}, size={self._size})"

    def search(self, queries: np.ndarray, k: int, ef: int | None = None, num_threads: int = 0) -> SearchResult:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        parts = self._ray.get([a.search.remote(queries, k, ef) for a in self.actors])
        return merge_top_k(parts, k)

    def get_vectors(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.zeros((len(ids), self.dim), np.float32)
        found = np.zeros(len(ids), bool)
        for mine, vectors in self._ray.get([a.get_vectors.remote(ids) for a in self.actors]):
            out[mine] = vectors
            found |= mine
        if not found.all():
            raise ValueError(f"ids not in the index: {ids[~found][:5].tolist()}")
        return out

    def stats(self) -> dict:
        per = [i["stats"] for i in self._info]
        return {"shards": len(per), "actors": True, "nodes": sum(p["nodes"] for p in per),
                "live": sum(p["live"] for p in per), "deleted": sum(p["deleted"] for p in per),
                "per_shard": [{"live": p["live"]} for p in per], "memory_bytes": sum(p["memory_bytes"] for p in per),
                "dim": self.dim, "metric": self.metric, "M": self.M, "ef_construction": self.ef_construction}

    def add(self, *args, **kwargs):
        raise ValueError("a store served by shard actors is read-only; write through Engine.open(store)")

    remove = add

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []
