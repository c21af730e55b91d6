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


def test_answers_made_before_the_support_signal_gain_it_from_their_passages_made_again(bench, tmp_path, smollm):
    """A cached engine answer set without the support signal gets it from its texts and the engine's passages
    retrieved again: the same values the collection computed while answering. An engine that now retrieves other
    passages (its best reranker score no longer the recorded one) is refused rather than mixed in."""
    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import QAItem
    from certrag.engine import Engine
    from certrag.rerank import CrossEncoderReranker
    from certrag.train.factuality import collect_engine

    rows = wiki_leads()[:20]
    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in rows]
    items = [QAItem(question=f"What is {t}?", answers=(t,), title=t, passage=x) for t, x, _ in rows[:3]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=4, rerank=True))
    with Engine.build(docs, tmp_path / "s", config, reranker=CrossEncoderReranker.default(), progress=False) as e:
        data = collect_engine(e, smollm, items, max_new_tokens=6, progress=False)
        old = {k: v for k, v in data.items() if k != "support"}
        np.testing.assert_array_equal(bench.support_of(old, items, "engine", engine=e), data["support"])
        assert np.isfinite(data["support"]).all() and ((data["support"] >= 0) & (data["support"] <= 1)).all()
        moved = {**old, "top_rerank": old["top_rerank"] + 1.0}
        with pytest.raises(SystemExit, match="delete the cached set"):
            bench.support_of(moved, items, "engine", engine=e)
