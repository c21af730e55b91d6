"""The encoders' dynamic batcher (certrag.runtime.batching): every caller gets exactly its own rows, whatever it was
batched with, cut into or run beside; several model instances share the queue. The oracle is the model function
applied to each caller's items alone."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from certrag.runtime.batching import BatchingReranker, DynamicBatcher


class Recorder:
    """A deterministic row-wise model that records every run: which worker ran it and which items it held."""

    def __init__(self, tag: str, delay: float = 0.0, fail_on=None):
        self.tag, self.delay, self.fail_on = tag, delay, fail_on
        self.runs: list[tuple[str, list]] = []
        self.lock = threading.Lock()

    def __call__(self, items: list) -> np.ndarray:
        with self.lock:
            self.runs.append((self.tag, list(items)))
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"bad item {self.fail_on}")
        time.sleep(self.delay)
        x = np.asarray(items, dtype=np.float64)
        return np.stack([x * 2 + 1, x ** 2], axis=1)  # two columns: rows must come back whole and in order


def _requests(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out, start = [], 0
    for _ in range(n):
        size = int(rng.integers(1, 40))
        out.append(list(range(start, start + size)))
        start += size
    return out


@pytest.mark.parametrize("split,instances", [(False, 1), (True, 1), (True, 3), (False, 2)])
def test_every_caller_gets_its_own_rows(split, instances):
    models = [Recorder(f"w{i}", delay=0.002) for i in range(instances)]
    batcher = DynamicBatcher(models, max_batch=16, max_wait_ms=3, split=split)
    requests = _requests(60)
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(batcher.submit, requests))
    batcher.close()
    reference = Recorder("ref")
    for items, rows in zip(requests, got):
        np.testing.assert_array_equal(rows, reference(items))
    runs = [items for m in models for _, items in m.runs]
    assert sorted(x for items in runs for x in items) == sorted(x for r in requests for x in r)  # each item once
    if split:
        assert max(len(items) for items in runs) <= 16
    else:  # a caller's items run whole, in one run
        owner = {x: i for i, r in enumerate(requests) for x in r}
        for items in runs:
            for i in {owner[x] for x in items}:
                assert set(requests[i]) <= set(items)
    if instances > 1:
        assert all(m.runs for m in models), "every instance took a share of the load"


def test_one_request_is_shared_among_idle_instances():
    models = [Recorder(f"w{i}", delay=0.05) for i in range(2)]
    batcher = DynamicBatcher(models, max_batch=64, max_wait_ms=1, split=True)
    time.sleep(0.05)  # both workers idle
    rows = batcher.submit(list(range(20)))
    batcher.close()
    np.testing.assert_array_equal(rows, Recorder("ref")(list(range(20))))
    sizes = sorted(len(items) for m in models for _, items in m.runs)
    assert sizes == [10, 10], sizes


def test_a_failed_run_reaches_its_callers_and_the_batcher_goes_on():
    model = Recorder("w0", fail_on=7)
    batcher = DynamicBatcher(model, max_batch=64, max_wait_ms=1)
    with pytest.raises(RuntimeError, match="bad item 7"):
        batcher.submit([5, 6, 7])
    np.testing.assert_array_equal(batcher.submit([1, 2]), Recorder("ref")([1, 2]))
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit([1])
    with pytest.raises(ValueError, match="max_batch"):
        DynamicBatcher(model, max_batch=0)
    with pytest.raises(ValueError, match="fn"):
        DynamicBatcher([], max_batch=4)


def test_reranker_instances_score_as_the_reranker_alone():
    pytest.importorskip("torch")
    from certrag.data.corpora import wiki_leads
    from certrag.rerank import CrossEncoderReranker

    reranker = CrossEncoderReranker.default()
    rows = wiki_leads()[:60]
    passages = [f"{t}. {x[:400]}" for t, x, _ in rows]
    questions = [f"what is known about {t}" for t, _, _ in rows[:6]]
    wrapped = BatchingReranker(reranker, instances=2, threads=1, max_batch=16, max_wait_ms=2)
    with pytest.raises(ValueError, match="instances"):
        BatchingReranker(reranker, instances=0)

    def ask(i):
        group = passages[i * 10:(i + 1) * 10]
        return wrapped.cross_scores([questions[i]] * len(group), group)

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    wrapped.batcher.close()
    assert wrapped.batcher.instances == 2
    for i, scores in enumerate(got):
        group = passages[i * 10:(i + 1) * 10]
        alone = reranker.cross_scores([questions[i]] * len(group), group)
        np.testing.assert_allclose(scores, alone, rtol=1e-5, atol=1e-5)
        assert np.argsort(-scores).tolist() == np.argsort(-alone).tolist()
    with pytest.raises(ValueError, match="num_threads"):
        reranker.replica(num_threads=0)
