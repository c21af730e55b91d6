"""Dynamic batching in front of the encoders, the way Triton Inference Server's dynamic batcher and
text-embeddings-inference gather concurrent requests: callers hand in their items and wait; worker threads (one per
model instance) take what is queued -- up to max_batch items, waiting at most max_wait_ms for more once the first has
come -- run it as one call and hand each caller its own rows back.

split=True lets a caller's items be cut across runs, for models whose rows do not depend on their batch (certrag's
encoders: length-bucketed, grid-padded batches). With several instances an idle one then takes an equal share of
what is queued, so even one request is scored by all of them at once (Triton's instance groups, at the level of
items); without split, a caller's items run whole, in one run.

The wrappers (BatchingEmbedder, BatchingReranker) implement the stage protocols (certrag.protocols) with the wrapped
model's name and identity, so the engine's retrieval runs on them unchanged; batched(stages) wraps an entry point's
Stages (certrag serve).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np


class _Request:
    """A caller's items, what of them has been handed to a run, and the rows that have come back."""

    __slots__ = ("items", "future", "taken", "pending", "rows")

    def __init__(self, items: list, future: Future) -> None:
        self.items, self.future = items, future
        self.taken = 0  # items handed to runs so far (a prefix)
        self.pending = len(items)  # items whose rows have not come back
        self.rows = None  # the assembled result, allocated when the first part returns

    def put(self, start: int, out: np.ndarray) -> bool:
        """Stores the rows of items [start, start + len(out)); True when the request is complete."""
        if self.rows is None:
            self.rows = np.empty((len(self.items),) + out.shape[1:], dtype=out.dtype)
        self.rows[start:start + len(out)] = out
        self.pending -= len(out)
        return self.pending == 0


class DynamicBatcher:
    def __init__(self, fn: Callable[[list], np.ndarray] | Sequence[Callable[[list], np.ndarray]], *,
                 max_batch: int = 64, max_wait_ms: float = 2.0, name: str = "batcher",
                 on_batch: Callable[[str, int, int], None] | None = None, split: bool = False) -> None:
        """fn: the model call, or one per model instance (a worker thread each). split: a caller's items may be
        cut across runs (only for a model whose rows do not depend on what they are batched with)."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer; got {max_batch!r}")
        if not (max_wait_ms >= 0):
            raise ValueError(f"max_wait_ms must be >= 0; got {max_wait_ms!r}")
        fns = [fn] if callable(fn) else list(fn)
        if not fns or not all(callable(f) for f in fns):
            raise ValueError("fn must be a callable or a non-empty sequence of callables")
        self.fn = fns[0]
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1e3
        self.name = name
        self.split = bool(split)
        self.on_batch = on_batch  # (name, items, requests) after every run: for metrics
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._idle = 0  # workers waiting for work
        self._workers = [threading.Thread(target=self._run, args=(f,), name=f"certrag-{name}-{i}", daemon=True)
                         for i, f in enumerate(fns)]
        for w in self._workers:
            w.start()

    @property
    def instances(self) -> int:
        return len(self._workers)

    def depth(self) -> int:
        with self._cv:
            return sum(len(r.items) - r.taken for r in self._queue)

    def submit(self, items: Sequence) -> np.ndarray:
        """Runs items (with whatever else is queued) and returns their rows of fn's result, in order."""
        items = list(items)
        if not items:
            return self.fn([])
        request = _Request(items, Future())
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append(request)
            self._cv.notify_all()
        return request.future.result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for w in self._workers:
            w.join(timeout=5)

    def _queued(self) -> int:
        return sum(len(r.items) - r.taken for r in self._queue)

    def _take(self) -> list[tuple[_Request, int, int]]:
        """The next run: (request, start, end) parts, at most max_batch items (a whole request may exceed it
        without split); with split, an equal share of the queue among the idle workers."""
        with self._cv:
            self._idle += 1
            try:
                while True:
                    while not self._queue and not self._closed:
                        self._cv.wait()
                    if not self._queue:
                        return []
                    deadline = time.monotonic() + self.max_wait
                    while self._queue and not self._closed and self._queued() < self.max_batch:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                    if self._queue:  # else another worker took it all meanwhile: wait again
                        return self._parts()
            finally:
                self._idle -= 1

    def _parts(self) -> list[tuple[_Request, int, int]]:
        limit = self.max_batch
        if self.split:
            limit = min(limit, max(1, math.ceil(self._queued() / max(1, self._idle))))
        parts, size = [], 0
        while self._queue and size < limit:
            r = self._queue[0]
            rest = len(r.items) - r.taken
            if self.split:
                n = min(rest, limit - size)
            elif parts and size + rest > limit:
                break
            else:
                n = rest
            parts.append((r, r.taken, r.taken + n))
            r.taken += n
            size += n
            if r.taken == len(r.items):
                self._queue.popleft()
        return parts

    def _run(self, fn: Callable[[list], np.ndarray]) -> None:
        while True:
            parts = self._take()
            if not parts:
                return
            flat = [x for r, a, b in parts for x in r.items[a:b]]
            try:
                out = fn(flat)
            except BaseException as exc:  # every caller of the run hears of it
                with self._cv:
                    for r, _, _ in parts:
                        if not r.future.done():
                            r.future.set_exception(exc)
                        if r in self._queue:  # its other items need not run
                            self._queue.remove(r)
                continue
            if self.on_batch is not None:
                self.on_batch(self.name, len(flat), len(parts))
            at, done = 0, []
            with self._cv:
                for r, a, b in parts:
                    if not r.future.done() and r.put(a, out[at:at + b - a]):
                        done.append(r)
                    at += b - a
            for r in done:
                r.future.set_result(r.rows)


class BatchingEmbedder:
    """An Embedder whose embed() calls from many threads are gathered into shared forward passes."""

    def __init__(self, embedder, *, max_batch: int = 64, max_wait_ms: float = 2.0, on_batch=None) -> None:
        self.inner = embedder
        self.batcher = DynamicBatcher(embedder.embed, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                      name="embedder", on_batch=on_batch)
        self.name, self.dim = embedder.name, embedder.dim
        self.backend = getattr(embedder, "backend", None)

    def embed(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        return self.batcher.submit(list(texts))

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        return self.inner.count_tokens(texts)


class BatchingReranker:
    """A CrossEncoderReranker whose (question, passage) pairs from many threads are scored in shared passes.

    instances: model instances over the same weights (CrossEncoderReranker.replica), each with threads torch
    threads, each fed by its own worker; a request's pairs may be cut across them (a pair's score does not depend
    on its batch). One instance with the process's threads is the plain form."""

    def __init__(self, reranker, *, max_batch: int = 64, max_wait_ms: float = 2.0, on_batch=None,
                 instances: int = 1, threads: int | None = None) -> None:
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ValueError(f"instances must be a positive integer; got {instances!r}")
        self.inner = reranker
        models = ([reranker] if instances == 1 and threads is None
                  else [reranker.replica(num_threads=threads) for _ in range(instances)])
        self.batcher = DynamicBatcher([functools.partial(self._pairs, m) for m in models], max_batch=max_batch,
                                      max_wait_ms=max_wait_ms, name="reranker", on_batch=on_batch, split=True)
        self.name, self.dense_weight, self.skip_rule = reranker.name, reranker.dense_weight, reranker.skip_rule
        self.identity = reranker.identity
        self.card, self.backend = getattr(reranker, "card", {}), getattr(reranker, "backend", None)

    @staticmethod
    def _pairs(model, pairs: list[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        return model.cross_scores([q for q, _ in pairs], [p for _, p in pairs])

    def cross_scores(self, questions: list[str], passages: list[str], *, batch_size: int | None = None) -> np.ndarray:
        if len(questions) != len(passages):
            raise ValueError("questions and passages must have the same length")
        return self.batcher.submit(list(zip(questions, passages)))

    def score(self, question: str, passages: list[str], dense_scores: np.ndarray, *,
              batch_size: int | None = None) -> np.ndarray:
        from certrag.rerank import fused_scores

        return fused_scores(self, question, passages, dense_scores)


def batched(stages, *, max_batch: int = 64, max_wait_ms: float = 2.0, on_batch=None, rerank_instances: int = 1):
    """stages (certrag.stages.Stages) with the embedder and the reranker behind dynamic batchers; rerank_instances
    > 1 splits the process's torch threads among that many reranker instances."""
    embedder = BatchingEmbedder(stages.embedder, max_batch=max_batch, max_wait_ms=max_wait_ms, on_batch=on_batch)
    reranker = None
    if stages.reranker is not None:
        threads = None
        if rerank_instances > 1:
            from certrag.backends import import_torch

            threads = max(1, import_torch().get_num_threads() // rerank_instances)
        reranker = BatchingReranker(stages.reranker, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                    on_batch=on_batch, instances=rerank_instances, threads=threads)
    return stages.replace(embedder=embedder, reranker=reranker)
