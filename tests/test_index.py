"""certrag.HnswIndex against exact brute-force search, plus its input checks and contracts."""

import threading

import numpy as np
import pytest

import certrag
from certrag import HnswIndex
from certrag.data.vectors import exact_search, recall_at_k


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_recall_against_exact_search(metric, clustered_1001):
    base, queries = clustered_1001
    if metric == "l2":
        base = base * 3.0  # non-unit vectors, so l2 and ip rankings differ
    index = HnswIndex(dim=48, metric=metric, M=12, ef_construction=100, seed=3)
    index.add(base)
    truth_ids, truth_scores = exact_search(base, queries, 10, metric)
    result = index.search(queries, k=10, ef=100)
    assert result.ids.dtype == np.int64 and result.ids.shape == (97, 10)
    assert result.scores.dtype == np.float32 and result.scores.shape == (97, 10)
    assert recall_at_k(result.ids, truth_ids) >= 0.97
    # Scores follow the documented convention and come best first.
    assert np.all(np.diff(result.scores, axis=1) <= 1e-6)
    first = result.ids[:, 0] == truth_ids[:, 0]
    np.testing.assert_allclose(result.scores[first, 0], truth_scores[first, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_tiny_indexes_are_exact(n, rng):
    base = rng.standard_normal((n, 5)).astype(np.float32)
    queries = rng.standard_normal((11, 5)).astype(np.float32)
    for metric in ("ip", "l2", "cosine"):
        index = HnswIndex(dim=5, metric=metric)
        index.add(base)
        truth, _ = exact_search(base, queries, n, metric)
        got = index.search(queries, k=n)
        np.testing.assert_array_equal(got.ids, truth)


def test_k_above_the_index_size_gives_as_many_results_as_vectors(rng):
    """Results are sized min(k, live vectors): k = 2**31 - 1 on 50 vectors used to allocate k x n results (16 GiB)."""
    index = HnswIndex(dim=3)
    index.add(rng.standard_normal((4, 3)).astype(np.float32), ids=[10, 11, 12, 13])
    result = index.search(rng.standard_normal((2, 3)).astype(np.float32), k=6)
    assert result.ids.shape == result.scores.shape == (2, 4)
    assert all(sorted(row) == [10, 11, 12, 13] for row in result.ids.tolist())
    assert np.all(np.isfinite(result.scores))
    big = HnswIndex(dim=3)
    big.add(rng.standard_normal((50, 3)).astype(np.float32))
    for k in (2**31 - 1, 10**8):
        huge = big.search(np.ones((3, 3), dtype=np.float32), k=k)
        assert huge.ids.shape == (3, 50) and sorted(huge.ids[0].tolist()) == list(range(50))
    big.remove([0, 1])
    assert big.search(np.ones(3, dtype=np.float32), k=100).ids.shape == (1, 48)


def test_an_empty_index_returns_no_columns():
    result = HnswIndex(dim=3).search(np.ones((2, 3), dtype=np.float32), k=2)
    assert result.ids.shape == result.scores.shape == (2, 0)
    with pytest.raises(ValueError, match="queries"):  # the queries are still checked
        HnswIndex(dim=3).search(np.full((1, 3), np.nan, dtype=np.float32), k=2)


def test_ids_default_to_a_continuing_sequence(rng):
    index = HnswIndex(dim=4)
    assert index.add(rng.standard_normal((3, 4))).tolist() == [0, 1, 2]
    index.add(rng.standard_normal((1, 4)), ids=[41])
    assert index.add(rng.standard_normal((2, 4))).tolist() == [42, 43]
    assert index.ids().tolist() == [0, 1, 2, 41, 42, 43]
    assert len(index) == 6 and 41 in index and 5 not in index


def test_float64_is_cast_and_a_single_query_is_one_row(rng):
    base = rng.standard_normal((20, 6))  # float64
    index = HnswIndex(dim=6, metric="l2")
    index.add(base)
    np.testing.assert_array_equal(index.get_vectors([3]), base[3:4].astype(np.float32))
    result = index.search(base[3], k=1)
    assert result.ids.shape == (1, 1) and result.ids[0, 0] == 3
    assert result.scores[0, 0] == pytest.approx(0.0, abs=1e-5)


def test_cosine_stores_normalised_vectors():
    index = HnswIndex(dim=2, metric="cosine")
    index.add(np.array([[3.0, 4.0]], dtype=np.float32))
    np.testing.assert_allclose(index.get_vectors([0]), [[0.6, 0.8]], rtol=1e-6)
    assert index.search(np.array([[6.0, 8.0]]), k=1).scores[0, 0] == pytest.approx(1.0, abs=1e-6)


def test_remove_hides_ids_and_allows_re_adding(clustered_1001):
    base, queries = clustered_1001
    index = HnswIndex(dim=48, M=8, ef_construction=64)
    index.add(base)
    truth, _ = exact_search(base, queries, 1)
    gone = np.unique(truth[:, 0])
    assert index.remove(gone) == len(gone)
    assert index.remove(gone) == 0  # already gone: ignored
    assert index.remove([10**12]) == 0  # unknown: ignored
    assert len(index) == len(base) - len(gone)
    result = index.search(queries, k=10, ef=80)
    assert not np.isin(result.ids, gone).any()
    keep = np.setdiff1d(np.arange(len(base)), gone)
    truth_rest, _ = exact_search(base[keep], queries, 10)
    assert recall_at_k(result.ids, keep[truth_rest]) >= 0.95
    stats = index.stats()
    assert stats["deleted"] == len(gone) and stats["live"] == len(index)
    index.add(base[gone[:3]], ids=gone[:3])
    assert index.search(base[gone[0]], k=1).ids[0, 0] == gone[0]
    with pytest.raises(ValueError, match="not in the index"):
        index.get_vectors([gone[5]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=0), "dim"),
        (dict(dim=4, metric="dot"), "metric"),
        (dict(dim=4, M=1), "M"),
        (dict(dim=4, ef_construction=0), "ef_construction"),
        (dict(dim=4, seed=-1), "seed"),
        (dict(dim=2.5), "dim"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HnswIndex(**kwargs)


def test_bad_add_input_names_the_argument_and_changes_nothing(rng):
    index = HnswIndex(dim=4)
    index.add(rng.standard_normal((5, 4)).astype(np.float32))
    good = rng.standard_normal((3, 4)).astype(np.float32)
    nan = good.copy()
    nan[1, 2] = np.nan
    inf = good.copy()
    inf[2, 0] = np.inf
    cases = [
        (dict(vectors=rng.standard_normal((3, 5)).astype(np.float32)), r"vectors must have shape \(n, 4\)"),
        (dict(vectors=np.ones((3, 4), dtype=np.int32)), "vectors must be float32"),
        (dict(vectors=np.ones((3, 4), dtype=np.float16)), "vectors must be float32"),
        (dict(vectors=nan), r"vectors\[1\] holds a NaN"),
        (dict(vectors=inf), r"vectors\[2\] holds a NaN or infinite"),
        (dict(vectors=good, ids=[7, 8, 7]), r"ids\[2\] = 7 appears more than once"),
        (dict(vectors=good, ids=[7, -1, 9]), r"ids\[1\] is -1"),
        (dict(vectors=good, ids=[7, 3, 9]), r"ids\[1\] = 3 is already in the index"),
        (dict(vectors=good, ids=[7, 8]), "one entry per vector"),
        (dict(vectors=good, ids=[7.0, 8.0, 9.0]), "ids must hold integers"),
        (dict(vectors=good, num_threads=-2), "num_threads"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            index.add(**kwargs)
        assert len(index) == 5 and index.ids().tolist() == [0, 1, 2, 3, 4]
    cosine = HnswIndex(dim=4, metric="cosine")
    with pytest.raises(ValueError, match=r"vectors\[0\] is all zeros"):
        cosine.add(np.zeros((1, 4), dtype=np.float32))


def test_bad_search_input_names_the_argument(rng):
    index = HnswIndex(dim=4, metric="cosine")
    index.add(rng.standard_normal((5, 4)))
    q = rng.standard_normal((2, 4)).astype(np.float32)
    bad_q = q.copy()
    bad_q[1, 1] = np.nan
    cases = [
        (dict(queries=q, k=0), "k must be at least 1"),
        (dict(queries=q, k=-3), "k must be at least 1"),
        (dict(queries=q, k=2, ef=0), "ef must be at least 1"),
        (dict(queries=q, k=1.5), "k must be an integer"),
        (dict(queries=q[:, :3], k=1), r"queries must .*shape \(n, 4\)"),
        (dict(queries=np.ascontiguousarray(q[:, :3]), k=1), r"queries must .*shape \(n, 4\)"),
        (dict(queries=q.astype(np.int64), k=1), "queries must be float32"),
        (dict(queries=bad_q, k=1), r"queries\[1\] holds a NaN"),
        (dict(queries=np.zeros((1, 4)), k=1), r"queries\[0\] is all zeros"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            index.search(**kwargs)


def test_larger_ef_never_lowers_recall_much(clustered_1001):
    base, queries = clustered_1001
    index = HnswIndex(dim=48, M=4, ef_construction=16, seed=1)  # a deliberately weak graph
    index.add(base)
    truth, _ = exact_search(base, queries, 10)
    narrow = recall_at_k(index.search(queries, k=10, ef=10).ids, truth)
    wide = recall_at_k(index.search(queries, k=10, ef=400).ids, truth)
    assert wide >= narrow and wide >= 0.97


def test_same_seed_single_thread_builds_identical_files(tmp_path, clustered_1001):
    base, _ = clustered_1001
    paths = []
    for name in ("a", "b"):
        index = HnswIndex(dim=48, seed=11)
        index.add(base, num_threads=1)
        paths.append(tmp_path / name)
        index.save(paths[-1])
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_concurrent_searches_and_adds(clustered_1001):
    base, queries = clustered_1001
    index = HnswIndex(dim=48, M=8, ef_construction=64)
    index.add(base[:200])
    errors = []
    added = threading.Event()

    def writer(lo, hi):
        try:
            for start in range(lo, hi, 50):
                index.add(base[start:min(hi, start + 50)], ids=np.arange(start, min(hi, start + 50)), num_threads=1)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    def reader():
        try:
            while not added.is_set():
                result = index.search(queries, k=5, ef=32, num_threads=1)
                valid = (result.ids >= -1) & (result.ids < len(base))
                if not valid.all():
                    errors.append(AssertionError(f"invalid ids {result.ids[~valid]}"))
        except Exception as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(200 + i * 267, min(1001, 200 + (i + 1) * 267))) for i in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    added.set()
    for t in readers:
        t.join()
    assert not errors, errors[:3]
    assert len(index) == 1001 and sorted(index.ids().tolist()) == list(range(1001))
    truth, _ = exact_search(base, queries, 10)
    assert recall_at_k(index.search(queries, k=10, ef=100).ids, truth) >= 0.95


@pytest.mark.parametrize("level", certrag.info()["simd_compiled"])
@pytest.mark.parametrize("dim", [1, 7, 15, 16, 17, 33, 384, 1001])
def test_distance_kernels_match_float64(level, dim, rng):
    from certrag import _core

    a = rng.standard_normal((9, dim)).astype(np.float32)
    b = rng.standard_normal((9, dim)).astype(np.float32)
    try:
        dot = _core.distance(a, b, "dot", level)
    except ValueError as exc:
        pytest.skip(str(exc))
    l2 = _core.distance(a, b, "l2sq", level)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    tol = 1e-5 * dim
    np.testing.assert_allclose(dot, np.sum(a64 * b64, axis=1), rtol=1e-5, atol=tol)
    np.testing.assert_allclose(l2, np.sum((a64 - b64) ** 2, axis=1), rtol=1e-5, atol=tol)


def test_info_reports_the_build():
    info = certrag.info()
    assert info["version"] == certrag.__version__
    assert info["simd_active"] in info["simd_compiled"]
    for key in ("compiler", "threads", "build_type", "index_format_version"):
        assert key in info
