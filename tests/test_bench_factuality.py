"""bench_factuality's paired comparison of two scores on the same held-out answers (benchmarks/bench_factuality.py)."""

import numpy as np
import pytest


@pytest.fixture()
def bench(bench_dirs):
    pytest.importorskip("sklearn")
    import bench_factuality

    return bench_factuality


def test_the_auroc_gain_is_paired_and_its_interval_covers_what_it_should(bench):
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 600)
    good, weak = y + rng.normal(size=600), y * 0.3 + rng.normal(size=600)
    same = bench.auroc_gain(y, good, good, reps=300)
    assert same["gain"] == 0 and same["lo"] == 0 and same["hi"] == 0 and same["n"] == 600
    g = bench.auroc_gain(y, good, weak, reps=300)
    assert g["gain"] == pytest.approx(roc_auc_score(y, good) - roc_auc_score(y, weak))
    assert 0 < g["lo"] < g["gain"] < g["hi"]
    missing = good.copy()
    missing[:50] = np.nan  # an answer one score lacks is left out of both
    m = bench.auroc_gain(y, missing, weak, reps=300)
    assert m["n"] == 550
    assert m["gain"] == pytest.approx(roc_auc_score(y[50:], good[50:]) - roc_auc_score(y[50:], weak[50:]))
    assert np.isnan(bench.auroc_gain(np.ones(10), good[:10], weak[:10])["gain"])
