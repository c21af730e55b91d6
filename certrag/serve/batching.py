"""Dynamic batching in front of the encoders, the way Triton Inference Server's dynamic batcher and
text-embeddings-inference gather concurrent requests: callers hand in their items and wait; one worker thread per
model takes what is queued -- up to max_batch items, waiting at most max_wait_ms for more once the first has come --
runs it as one call and hands each caller its own rows back.

The wrappers (BatchingEmbedder, BatchingReranker) look like the models they wrap, so the engine's retrieval runs on
them unchanged. A caller's items are never split across two runs, so one large request still runs whole.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np


class DynamicBatcher:
    def __init__(self, fn: Callable[[list], np.ndarray], *, max_batch: int = 64, max_wait_ms: float = 2.0,
                 name: str = "batcher", on_batch: Callable[[str, int, int], None] | None = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer; got {max_batch!r}")
        if not (max_wait_ms >= 0):
            raise ValueError(f"max_wait_ms must be >= 0; got {max_wait_ms!r}")
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1e3
        self.name = name
        self.on_batch = on_batch  # (name, items, requests) after every run: for metrics
        self._queue: deque[tuple[list, Future]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"certrag-{name}", daemon=True)
        self._worker.start()

    def depth(self) -> int:
        with self._cv:
            return sum(len(items) for items, _ in self._queue)

    def submit(self, items: Sequence) -> np.ndarray:
        """Runs items (with whatever else is queued) and returns their rows of fn's result, in order."""
        items = list(items)
        if not items:
            return self.fn([])
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append((items, fut))
            self._cv.notify()
        return fut.result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=5)

    def _take(self) -> list[tuple[list, Future]]:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if not self._queue:
                return []
            deadline = time.monotonic() + self.max_wait
            while True:
                size = sum(len(items) for items, _ in self._queue)
                left = deadline - time.monotonic()
                if size >= self.max_batch or left <= 0 or self._closed:
                    break
                self._cv.wait(left)
            taken, size = [], 0
            while self._queue and (not taken or size + len(self._queue[0][0]) <= self.max_batch):
                items, fut = self._queue.popleft()
                taken.append((items, fut))
                size += len(items)
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if not taken:
                return
            flat = [x for items, _ in taken for x in items]
            try:
                out = self.fn(flat)
            except BaseException as exc:  # every caller of the run hears of it
                for _, fut in taken:
                    fut.set_exception(exc)
                continue
            if self.on_batch is not None:
                self.on_batch(self.name, len(flat), len(taken))
            at = 0
            for items, fut in taken:
                fut.set_result(out[at:at + len(items)])
                at += len(items)


class BatchingEmbedder:
    """An Embedder whose embed() calls from many threads are gathered into shared forward passes."""

    def __init__(self, embedder, *, max_batch: int = 64, max_wait_ms: float = 2.0, on_batch=None) -> None:
        self.inner = embedder
        self.batcher = DynamicBatcher(embedder.embed, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                      name="embedder", on_batch=on_batch)

    def embed(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        return self.batcher.submit(list(texts))

    def __getattr__(self, name):  # name, dim, backend, count_tokens, _counter, ...
        return getattr(self.inner, name)


class BatchingReranker:
    """A CrossEncoderReranker whose (question, passage) pairs from many threads are scored in shared passes."""

    def __init__(self, reranker, *, max_batch: int = 64, max_wait_ms: float = 2.0, on_batch=None) -> None:
        self.inner = reranker
        self.batcher = DynamicBatcher(self._pairs, max_batch=max_batch, max_wait_ms=max_wait_ms, name="reranker",
                                      on_batch=on_batch)

    def _pairs(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        return self.inner.cross_scores([q for q, _ in pairs], [p for _, p in pairs])

    def cross_scores(self, questions: list[str], passages: list[str], *, batch_size: int | None = None) -> np.ndarray:
        if len(questions) != len(passages):
            raise ValueError("questions and passages must have the same length")
        return self.batcher.submit(list(zip(questions, passages)))

    def score(self, question: str, passages: list[str], dense_scores: np.ndarray, *,
              batch_size: int | None = None) -> np.ndarray:
        from certrag.rerank import fused_scores

        return fused_scores(self, question, passages, dense_scores)

    def __getattr__(self, name):  # name, dense_weight, skip_rule, identity, card, backend, ...
        return getattr(self.inner, name)
