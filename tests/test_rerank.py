"""The shipped cross-encoder reranker: its card, its fused score, and its ranking on questions it never saw."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from certrag.rerank import PACKAGE_RERANKER, PACKAGE_RERANKERS, CrossEncoderReranker  # noqa: E402


@pytest.fixture(scope="module")
def reranker():
    return CrossEncoderReranker.default()


@pytest.fixture(scope="module")
def reranker32():
    return CrossEncoderReranker.default("float32")


def _hf_cross_scores(questions, passages, folder=PACKAGE_RERANKER):
    """Independent path: the Hugging Face tokenizer and model classes on the same files, one padded batch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True,
                                                               dtype=torch.float32).eval()
    with torch.inference_mode():
        enc = tok(questions, passages, return_tensors="pt", padding=True, truncation="only_second", max_length=256)
        return model(**enc).logits[:, 0].numpy()


def test_the_shipped_reranker_loads_once_per_process_and_backend():
    assert CrossEncoderReranker.default() is CrossEncoderReranker.default("auto")
    assert CrossEncoderReranker.default("float32") is CrossEncoderReranker.default("float32")
    assert CrossEncoderReranker.default("float32") is not CrossEncoderReranker.default("bfloat16")


@pytest.mark.parametrize("name", list(PACKAGE_RERANKERS))
def test_shipped_model_is_small_half_precision_with_a_card(name):
    folder = PACKAGE_RERANKERS[name]
    weights = folder / "model.safetensors"
    assert weights.stat().st_size < 50e6
    from safetensors import safe_open

    with safe_open(str(weights), "np") as f:
        assert all(f.get_tensor(k).dtype == np.float16 for k in list(f.keys())[:5])
    card = json.loads((folder / "card.json").read_text())
    for key in ("data", "training", "held_out", "dense_weight", "remake"):
        assert key in card
    assert card["name"] == name and "train split" in card["data"]["source"]
    assert card["held_out"]["mrr10_reranker"] > card["held_out"]["mrr10_bi_encoder"]
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == card.get("layers", 6)
    assert np.isfinite(CrossEncoderReranker.default("float32", name).dense_weight)


def test_the_distilled_reranker_scores_as_the_model_classes_do_and_engines_choose_it_by_name(tmp_path):
    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.engine import Engine

    name = "certrag-minilm-l3-cross-encoder"
    small = CrossEncoderReranker.default("float32", name)
    questions, passages = _mixed_length_pairs()
    np.testing.assert_allclose(small.cross_scores(questions, passages),
                               _hf_cross_scores(questions, passages, PACKAGE_RERANKERS[name]), rtol=1e-4, atol=2e-4)
    with pytest.raises(ValueError, match="reranker must be one of"):
        EngineConfig(reranker="ms-marco-MiniLM")
    docs = [{"id": f"d{i}", "text": p} for i, p in enumerate(passages)]
    config = EngineConfig(chunker="fixed_sentence", encoder_backend="float32", reranker=name,
                          retrieval=RetrievalConfig(candidates=4))
    with Engine.build(docs, tmp_path / "s", config, progress=False) as engine:
        assert engine.reranker is small and engine.info()["models"]["reranker"] == name
    with Engine.open(tmp_path / "s", read_only=True) as engine:  # the store's config names it
        assert engine.reranker is small


def test_fused_score_is_cross_encoder_plus_weighted_dense(reranker32):
    q = "who wrote the novel pride and prejudice"
    passages = ["Pride and Prejudice\nPride and Prejudice is an 1813 novel by Jane Austen.",
                "Moby-Dick\nMoby-Dick is an 1851 novel by Herman Melville."]
    dense = np.array([0.6, 0.2], dtype=np.float32)
    got = reranker32.score(q, passages, dense)
    ce = _hf_cross_scores([q] * 2, passages)
    np.testing.assert_allclose(got, ce + reranker32.dense_weight * dense, rtol=1e-4, atol=1e-4)
    assert got[0] > got[1]
    with pytest.raises(ValueError, match="dense_scores"):
        reranker32.score(q, passages, dense[:1])


def _mixed_length_pairs():
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import passage_text

    leads = [passage_text(t, x) for t, x, _ in wiki_leads()[:40]]
    # lengths from a few words to past the 256-token limit, in no order
    passages = [p[: 30 + (i * 397) % 2000] for i, p in enumerate(leads[:13])]
    return ["who was the first president of the united states"] * len(passages), passages


def test_length_sorted_batches_score_as_one_padded_batch(reranker32):
    questions, passages = _mixed_length_pairs()
    want = _hf_cross_scores(questions, passages)
    for batch in (1, 3, 8, 32):
        got = reranker32.cross_scores(questions, passages, batch_size=batch)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4)
    assert reranker32.cross_scores([], []).shape == (0,)


@pytest.mark.parametrize("backend", ["bfloat16", "int8"])
def test_reduced_precision_backends_track_float32_or_fall_back(backend):
    from certrag.backends import resolve

    r = CrossEncoderReranker(backend=backend)
    assert r.backend == resolve(backend)
    questions, passages = _mixed_length_pairs()
    want = _hf_cross_scores(questions, passages)
    got = r.cross_scores(questions, passages)
    # bfloat16 keeps 8 bits of mantissa: logits (spread over ~15) move by a few hundredths; int8 with a scale per
    # token and per channel by about 0.1 (torch's dynamic int8, one scale per batch, moved them by up to 1.3)
    tol = {"float32": 2e-4, "bfloat16": 0.15, "int8": 0.4}[r.backend.backend]
    assert np.max(np.abs(got - want)) < tol
    # the ranking of clearly separated passages is kept
    top = np.argsort(-want)[:3]
    assert set(np.argsort(-got)[:3]) & set(top)


@pytest.mark.parametrize("name", list(PACKAGE_RERANKERS))
def test_reranker_does_not_rank_worse_than_the_bi_encoder_on_unseen_questions(name):
    from certrag.embed import Embedder
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import load_nq_open, passage_text
    from certrag.train.reranker import mrr_at_10

    items = load_nq_open(split="calibration")[:30]  # never used for training
    corpus = sorted({it.gold_text for it in items} | {passage_text(t, x) for t, x, _ in wiki_leads()[:300]})
    embedder = Embedder.default()
    emb = embedder.embed(corpus)
    dense_lists, fused_lists, golds = [], [], []
    for it, q in zip(items, embedder.embed([it.question for it in items])):
        scores = emb @ q
        top = list(np.argsort(-scores)[:8])
        gold = corpus.index(it.gold_text)
        if gold not in top:
            top[-1] = gold
        d = scores[top].astype(np.float32)
        dense_lists.append(d)
        fused_lists.append(CrossEncoderReranker.default("auto", name).score(it.question, [corpus[i] for i in top], d))
        golds.append(top.index(gold))
    dense_mrr, fused_mrr = mrr_at_10(dense_lists, golds), mrr_at_10(fused_lists, golds)
    assert fused_mrr >= dense_mrr - 0.03, (fused_mrr, dense_mrr)


def test_a_distilled_reranker_keeps_evenly_spaced_layers_ending_with_the_last():
    from click.testing import CliRunner

    from certrag.cli import main
    from certrag.train.reranker import kept_layers

    assert kept_layers(6, 3) == [1, 3, 5] and kept_layers(6, 2) == [2, 5] and kept_layers(6, 1) == [5]
    assert kept_layers(6, 6) == list(range(6)) and kept_layers(12, 4) == [2, 5, 8, 11]
    for total in range(1, 13):
        for keep in range(1, total + 1):
            got = kept_layers(total, keep)
            assert got == sorted(set(got)) and len(got) == keep and got[-1] == total - 1 and got[0] >= 0
    with pytest.raises(ValueError, match="keep"):
        kept_layers(6, 7)
    res = CliRunner().invoke(main, ["train-reranker", "--layers", "0", "--out", "unused"])
    assert res.exit_code != 0 and "--layers" in res.output


def test_train_reranker_refuses_a_held_out_share_outside_zero_to_one():
    from click.testing import CliRunner

    from certrag.cli import main

    for share in ("0", "1", "1.5"):
        res = CliRunner().invoke(main, ["train-reranker", "--val-fraction", share, "--out", "unused"])
        assert res.exit_code != 0 and "--val-fraction" in res.output
    from certrag.train.reranker import train_reranker

    for share in (0, 1.0, -0.2, True, "0.5"):  # said before any model or data is loaded
        with pytest.raises(ValueError, match="val_fraction"):
            train_reranker("unused", val_fraction=share)


def test_separation_auroc_counts_gold_above_the_best_answer_free_candidate_across_questions():
    from certrag.train.reranker import separation_auroc

    scores = [np.array([5.0, 9.0, 1.0]), np.array([2.0, 3.0, 8.0]), np.array([7.0, 6.0, 0.0])]
    golds = [0, 2, -1]  # the third question has no gold candidate
    free = [np.array([False, False, True]),  # candidate 1 holds the answer: not answer-free
            np.array([True, True, False]), np.array([True, True, True])]
    # golds 5, 8 against the best answer-free 1, 3, 7: pairs won 5>1, 5>3, 8>1, 8>3, 8>7 of 6
    assert separation_auroc(scores, golds, free) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="answer-free"):
        separation_auroc(scores, golds, [np.zeros(3, bool)] * 3)
