"""The QA harness: the noise protocol's passage sets, and a small real evaluation run."""

import pytest

pytest.importorskip("torch")

from certrag.config import EngineConfig, RetrievalConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402
from certrag.eval.metrics import answer_in_text, exact_match  # noqa: E402
from certrag.data.nq import load_nq_open, split_counts, split_of  # noqa: E402
from certrag.eval.qa import evaluate, markdown, noise_passages  # noqa: E402


def test_split_is_fixed_by_the_question_text():
    items = load_nq_open()
    counts = split_counts(items)
    assert sum(counts.values()) == len(items) == 2655
    assert abs(counts["train"] / len(items) - 0.4) < 0.03 and abs(counts["calibration"] / len(items) - 0.2) < 0.03
    assert split_of("Who wrote Hamlet?") == split_of("  who WROTE   hamlet? ")
    assert {it.split for it in load_nq_open(split="test")} == {"test"}
    with pytest.raises(ValueError, match="split"):
        load_nq_open(split="dev")


@pytest.fixture(scope="module")
def nq_engine(tmp_path_factory):
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import passage_text

    items = load_nq_open(split="test")[:12]
    docs = [{"id": f"nq:{i}", "text": it.gold_text} for i, it in enumerate(items)]
    docs += [{"id": f"wiki:{t}", "text": passage_text(t, x)} for t, x, _ in wiki_leads()[:150]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=10, rerank=False))
    engine = Engine.build(docs, tmp_path_factory.mktemp("nq") / "s", config, progress=False)
    yield engine, items
    engine.close()


@pytest.mark.parametrize("ratio, relevant", [(0.0, 5), (0.6, 2), (1.0, 0)])
def test_noise_protocol_passage_sets(nq_engine, ratio, relevant):
    engine, items = nq_engine
    for item in items[:6]:
        r = engine.retrieve(item.question, candidates=40)
        passages, n_rel, n_noise = noise_passages(item, r, 5, ratio)
        assert n_rel <= relevant and n_noise <= 5 - relevant and len(passages) == n_rel + n_noise
        if relevant:
            assert n_rel >= 1 and any(p.text == item.gold_text for p in passages)
        else:
            assert all(p.text != item.gold_text for p in passages)
        noisy = [p for p in passages if p.text != item.gold_text and not answer_in_text(p.text, item.answers)]
        assert len(noisy) == n_noise
    with pytest.raises(ValueError, match="noise ratio"):
        noise_passages(items[0], r, 5, 1.5)


def test_small_real_evaluation(nq_engine, smollm):
    engine, items = nq_engine
    engine.llm = smollm
    report = evaluate(engine, items[:3], "plain", progress=False, max_new_tokens=16)
    rows, summary = report["rows"], report["summary"]
    assert summary["n"] == 3 and len(rows) == 3
    for row in rows:
        assert row["em"] == exact_match(row["prediction"], row["answers"]) or row["rejected"]
        assert row["input_tokens"] > 0 and row["cost"] > 0
    assert summary["em"] == pytest.approx(sum(r["em"] for r in rows) / 3)
    noisy = evaluate(engine, items[:2], "chain_of_note", noise_ratio=1.0, progress=False, max_new_tokens=12)
    assert noisy["summary"]["noise_ratio"] == 1.0
    # A shared retrieval cache: retrieved once per question, and the same passages (so the same answers) as without.
    cache = {}
    cached = evaluate(engine, items[:2], "chain_of_note", noise_ratio=1.0, progress=False, max_new_tokens=12,
                      retrievals=cache)
    assert len(cache) == 2 and {q for q, _ in cache} == {it.question for it in items[:2]}
    assert [r["prediction"] for r in cached["rows"]] == [r["prediction"] for r in noisy["rows"]]
    assert [r["noisy_passages"] for r in cached["rows"]] == [r["noisy_passages"] for r in noisy["rows"]]
    assert "| plain | retrieved | 3 |" in markdown([summary, noisy["summary"]])
