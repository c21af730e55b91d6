"""Recording lookback ratios during generation: same tokens as plain generation, and the same ratios as
output_attentions gives (the Lookback Lens way) on the same tiny model and prompt."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from certrag.certify.lookback import (LookbackFeatures, graph_decode, lookback_features,  # noqa: E402
                                      passage_token_spans, ratios_from_masses, recording)


@pytest.fixture(scope="module")
def tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def _generate(model, ids, n, **kw):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              min_new_tokens=n, pad_token_id=0, **kw)


def _eager_oracle(model, prompt, n, P, chunks):
    """The oracle: eager attention with output_attentions, one full weight row per decode step -> span masses
    (steps, layers, heads, 2 + chunks) in float64, and the generated sequence."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = _generate(model, prompt, n, output_attentions=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation(previous)
    oracle = []
    for step in range(1, n):  # step 0 is the prefill
        per_layer = []
        for att in out.attentions[step]:
            w = att[0, :, -1, :].double().cpu().numpy()  # (heads, L)
            L = w.shape[-1]
            spans = [(0, P), (P, L)] + chunks
            per_layer.append(np.stack([w[:, a:b].sum(-1) for a, b in spans], -1))
        oracle.append(np.stack(per_layer))
    return np.stack(oracle), out


@pytest.mark.parametrize("fused_output", [False, True])
def test_recording_keeps_tokens_and_matches_output_attentions(tiny, fused_output):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 97, (1, 41), generator=g)
    P, chunks, n = 41, [(5, 12), (12, 30), (33, 33)], 9
    plain = _generate(tiny, prompt, n)
    with recording(tiny, P, chunks, fused_output=fused_output) as rec:
        recorded = _generate(tiny, prompt, n)
    assert torch.equal(plain, recorded)
    assert tiny.config._attn_implementation == "sdpa"  # restored
    features = rec.finish()
    assert features.steps == n - 1 and len(rec.masses) == n - 1
    masses = np.stack(rec.masses)  # (steps, layers, heads, 2 + chunks)
    assert masses.shape == (n - 1, 3, 8, 5)

    oracle, out = _eager_oracle(tiny, prompt, n, P, chunks)
    assert torch.equal(out.sequences, plain)
    np.testing.assert_allclose(masses, oracle, atol=1e-5, rtol=1e-4)
    mine, theirs = ratios_from_masses(masses, P, chunks), ratios_from_masses(oracle, P, chunks)
    for key in ("full", "chunks"):
        np.testing.assert_allclose(mine[key], theirs[key], atol=1e-5)
    # Lookback Lens' full-context ratio straight from the weights, for the first layer and decode step.
    w = out.attentions[1][0][0, :, -1, :].double().numpy()
    direct = w[:, :P].mean(-1) / (w[:, :P].mean(-1) + w[:, P:].mean(-1))
    np.testing.assert_allclose(mine["full"][0, 0], direct, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the fused Triton kernel path")
@pytest.mark.parametrize("fused_output", [False, True])
def test_recording_on_cuda_uses_the_kernel(tiny, monkeypatch, fused_output):
    import copy

    import certrag.kernels.lookback as kernel

    calls = []
    fused = kernel.lookback_attention
    monkeypatch.setattr(kernel, "lookback_attention", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    model = copy.deepcopy(tiny).cuda()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 97, (1, 300), generator=g).cuda()
    P, chunks, n = 300, [(10, 90), (90, 250), (260, 260)], 12
    plain = _generate(model, prompt, n)
    with recording(model, P, chunks, fused_output=fused_output) as rec:
        recorded = _generate(model, prompt, n)
    assert len(calls) == (n - 1) * model.config.num_hidden_layers  # every decode call of every layer
    assert torch.equal(plain, recorded)
    masses = np.stack(rec.masses)
    oracle, out = _eager_oracle(model, prompt, n, P, chunks)
    assert torch.equal(out.sequences, plain)
    np.testing.assert_allclose(masses, oracle, atol=1e-5, rtol=1e-4)


def test_static_cache_decoding_gives_generate_tokens_and_masses(tiny):
    """graph_decode's static-cache steps (run eagerly here; replayed from a CUDA graph on a GPU) give generate's
    greedy tokens, and, recording, the eager oracle's span masses over the buffer's valid prefix only."""
    prompt = torch.randint(1, 97, (1, 37), generator=torch.Generator().manual_seed(3))
    P, chunks, n = 37, [(4, 20), (20, 30)], 10
    plain = _generate(tiny, prompt, n)[:, P:]
    stats = {}
    assert torch.equal(graph_decode(tiny, prompt, n, stats=stats), plain)
    assert stats["steps"] == n - 2 and stats["seconds"] > 0
    with recording(tiny, P, chunks) as rec:
        assert torch.equal(graph_decode(tiny, prompt, n), plain)
    oracle, _ = _eager_oracle(tiny, prompt, n, P, chunks)
    np.testing.assert_allclose(np.stack(rec.masses), oracle, atol=1e-5, rtol=1e-4)
    assert torch.equal(graph_decode(tiny, prompt, 1), plain[:, :1])
    with pytest.raises(ValueError, match="input_ids must"):
        graph_decode(tiny, prompt[0], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        graph_decode(tiny, prompt, 0)


@pytest.mark.parametrize("check_every", [1, 3, 16])
def test_static_cache_decoding_stops_at_the_end_token_as_generate_does(tiny, check_every):
    """With eos_token_id, graph_decode keeps generate's tokens up to and including the first end token, and the
    recording holds generate's steps for them, whatever steps past it were computed before the host looked."""
    prompt = torch.randint(1, 97, (1, 37), generator=torch.Generator().manual_seed(3))
    P, chunks = 37, [(4, 20), (20, 30)]
    free = _generate(tiny, prompt, 12)[0, P:].tolist()
    end = next(i for i in range(3, 12) if free[i] not in free[:i])  # a token first produced at index end
    with torch.inference_mode():
        want = tiny.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             eos_token_id=free[end], pad_token_id=0)[0, P:].tolist()
    assert want == free[:end + 1]
    with recording(tiny, P, chunks) as ref:
        _generate(tiny, prompt, end + 1)
    with recording(tiny, P, chunks) as rec:
        got = graph_decode(tiny, prompt, 12, eos_token_id=[free[end], 96 if free[end] != 96 else 95],
                           check_every=check_every)
    assert got[0].tolist() == want
    assert rec.steps == end and len(rec.masses) == end
    np.testing.assert_allclose(np.stack(rec.masses), np.stack(ref.masses), atol=1e-6, rtol=1e-5)
    assert graph_decode(tiny, prompt, 12, eos_token_id=free[0])[0].tolist() == free[:1]  # the first token ends it
    with pytest.raises(ValueError, match="check_every"):
        graph_decode(tiny, prompt, 3, check_every=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: graph capture and the kernel")
@pytest.mark.parametrize("fused_output", [False, True])
def test_graph_captured_recording_on_cuda(tiny, fused_output):
    """In float32 on a GPU: the captured graph's tokens equal generate's (SDPA's output; the fused output within
    rounding, so compared on this seed), and the recorded masses the eager oracle's."""
    import copy

    model = copy.deepcopy(tiny).cuda()
    prompt = torch.randint(1, 97, (1, 300), generator=torch.Generator().manual_seed(2)).cuda()
    P, chunks, n = 300, [(10, 90), (90, 250), (260, 260)], 12
    plain = _generate(model, prompt, n)[:, P:]
    assert torch.equal(graph_decode(model, prompt, n), plain)
    with recording(model, P, chunks, fused_output=fused_output) as rec:
        assert torch.equal(graph_decode(model, prompt, n), plain)
    oracle, _ = _eager_oracle(model, prompt, n, P, chunks)
    np.testing.assert_allclose(np.stack(rec.masses), oracle, atol=1e-5, rtol=1e-4)


def test_ratios_hand_computed():
    # One step, one layer, one head; prompt of 10 with chunks (2, 4) and (4, 8); the step has 1 new token.
    # masses: prompt 0.6, new 0.4, chunk1 0.2 (2 tokens), chunk2 0.3 (4 tokens).
    m = np.array([[[[0.6, 0.4, 0.2, 0.3]]]])
    r = ratios_from_masses(m, 10, [(2, 4), (4, 8)])
    a_new = 0.4 / 1
    assert r["full"][0, 0, 0] == pytest.approx(0.06 / (0.06 + a_new))
    assert r["chunks"][0, 0, 0] == pytest.approx((0.5 / 6) / (0.5 / 6 + a_new))
    np.testing.assert_allclose(r["per_chunk"][0, 0, 0], [0.1 / (0.1 + a_new), 0.075 / (0.075 + a_new)])
    # Two steps: |new| grows to 2; features average over steps.
    m2 = np.concatenate([m, np.array([[[[0.5, 0.5, 0.1, 0.1]]]])])
    f = lookback_features(list(m2), 10, [(2, 4), (4, 8)])
    second = 0.05 / (0.05 + 0.25)
    assert f.full[0, 0] == pytest.approx((0.06 / 0.46 + second) / 2)
    # An empty chunk has no ratio; no chunks at all gives NaN chunk features.
    r = ratios_from_masses(np.array([[[[0.6, 0.4, 0.0]]]]), 10, [(3, 3)])
    assert np.isnan(r["per_chunk"]).all() and np.isnan(r["chunks"]).all()
    assert np.isnan(ratios_from_masses(m[..., :2], 10, [])["chunks"]).all()
    assert lookback_features([], 10, []).steps == 0


def test_a_batch_is_refused_rather_than_recorded_for_its_first_row(tiny):
    """A Recording holds one sequence: a batch of two used to record row 0 and drop row 1 without a word."""
    prompt = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    with recording(tiny, 12, [(2, 6)]):
        with pytest.raises(ValueError, match="one sequence per generation; got a batch of 2"):
            _generate(tiny, prompt, 3)
    assert tiny.config._attn_implementation == "sdpa"


def test_spans_outside_the_prompt_are_refused(tiny):
    with pytest.raises(ValueError, match="inside the prompt"):
        with recording(tiny, 10, [(5, 11)]):
            pass
    assert tiny.config._attn_implementation == "sdpa"


def test_passage_spans_from_offsets():
    text = 'sys <passage id="1">\nalpha beta\n</passage>\n<passage id="2">\ngamma\n</passage> q'
    words = [(m.start(), m.end()) for m in __import__("re").finditer(r"\S+", text)]
    spans = passage_token_spans(text, words)
    toks = [text[a:b] for a, b in words]
    assert [" ".join(toks[a:b]) for a, b in spans] == ["alpha beta", "gamma"]


def test_recorded_answer_with_the_real_small_model(smollm):
    from certrag.llm.prompts import Passage, plain_messages

    passages = [Passage("The Eiffel Tower is in Paris, France."), Passage("Bananas are rich in potassium.")]
    messages = plain_messages("Where is the Eiffel Tower?", passages)
    plain = smollm.generate(messages, max_new_tokens=12)
    rec = smollm.generate(messages, max_new_tokens=12, record_lookback=True)
    assert rec.text == plain.text and rec.output_tokens == plain.output_tokens
    f = rec.lookback
    assert isinstance(f, LookbackFeatures) and f.steps == rec.output_tokens - 1
    assert f.chunks.shape == (smollm.config.layers, smollm.config.heads)
    assert len(f.chunk_spans) == 2 and np.all((f.chunks > 0) & (f.chunks < 1))
    ids = smollm.prompt_ids(messages)
    for (a, b), p in zip(f.chunk_spans, passages):
        assert smollm.tokenizer.decode(ids[a:b]).strip() == p.text


def test_answer_p_correct_from_the_recorded_generation(tmp_path, smollm):
    """Answer.p_correct (was .confidence) from each kind of classifier, against the formula applied by hand to an
    independent recording of the same prompt: lookback ratios alone, stacked with the answer's mean token
    log-probability, and the calibrated log-probability alone (which records nothing)."""
    from certrag.certify.factuality import FactualityClassifier, Stack
    from certrag.config import EngineConfig, RetrievalConfig, SelectionConfig
    from certrag.data.corpora import wiki_leads
    from certrag.engine import Engine
    from certrag.llm.prompts import Passage, plain_messages

    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:15]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=4, rerank=False),
                          selection=SelectionConfig(method="topk", k=2))
    layers, heads = smollm.config.layers, smollm.config.heads
    n = layers * heads
    rng = np.random.default_rng(0)
    clf = FactualityClassifier(model="smollm2-135m-instruct", kind="chunks", layers=layers,
                               heads=heads, mean=np.full(n, 0.5), scale=np.full(n, 0.1),
                               coef=rng.normal(size=n) / n, intercept=0.1, card={})
    stack = Stack(mean=np.array([0.2, -1.0]), scale=np.array([1.5, 0.5]), coef=np.array([0.7, 1.3]), intercept=-0.2)
    stacked = dataclasses.replace(clf, stack=stack)
    logprob = FactualityClassifier(model="smollm2-135m-instruct", kind="logprob", layers=0, heads=0,
                                   mean=np.array([-1.0]), scale=np.array([0.5]), coef=np.array([2.0]),
                                   intercept=0.3, card={})
    question = f"What is {docs[2]['id'][5:]}?"
    with Engine.build(docs, tmp_path / "s", config, progress=False) as engine:
        engine.llm = smollm
        with pytest.raises(FileNotFoundError, match="train-factuality"):
            engine.answer(question, confidence=True)
        got = {}
        for name, c in (("chunks", clf), ("stacked", stacked), ("logprob", logprob)):
            engine.factuality = c
            got[name] = engine.answer(question, confidence=True, max_new_tokens=12)
        plain = engine.answer(question, max_new_tokens=12)
    a = got["chunks"]
    assert a.text == plain.text == got["logprob"].text and plain.p_correct is None and plain.lookback is None
    assert a.confidence == a.p_correct and a.to_dict()["p_correct"] == a.p_correct  # the former name reads it
    assert a.lookback.steps == a.output_tokens - 1
    # The features are those of an independent recording of the same prompt.
    passages = [Passage(t, chunk_id=int(c)) for t, c in zip(a.retrieval.selected_texts,
                                                           a.retrieval.selected_chunk_ids)]
    again = smollm.generate(plain_messages(question, passages), max_new_tokens=12, record_lookback=True)
    np.testing.assert_allclose(again.lookback.chunks, a.lookback.chunks, rtol=1e-5)

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    z1 = ((again.lookback.chunks.ravel().astype(np.float64) - 0.5) / 0.1) @ clf.coef + 0.1
    assert a.p_correct == pytest.approx(sigmoid(z1), rel=1e-4) and 0 < a.p_correct < 1
    z2 = ((np.array([z1, again.mean_logprob]) - stack.mean) / stack.scale) @ stack.coef + stack.intercept
    assert got["stacked"].p_correct == pytest.approx(sigmoid(z2), rel=1e-4)
    assert got["logprob"].lookback is None  # nothing recorded: the log-probability alone
    assert got["logprob"].p_correct == pytest.approx(sigmoid((again.mean_logprob + 1.0) / 0.5 * 2.0 + 0.3), rel=1e-4)
    # The classifier refuses features of another shape.
    small = FactualityClassifier(model="x", kind="chunks", layers=1, heads=2, mean=np.zeros(2), scale=np.ones(2),
                                 coef=np.ones(2), intercept=0.0, card={})
    with pytest.raises(ValueError, match="expects 1 layers x 2 heads"):
        small.predict(a.lookback)
    assert np.isnan(stacked.predict(a.lookback))  # a stacked classifier without the log-probability: no score


def test_classifier_round_trip_and_fit(tmp_path):
    pytest.importorskip("sklearn")
    from certrag.certify.factuality import FactualityClassifier
    from certrag.train.factuality import auroc, fit

    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 300)
    x = rng.normal(size=(300, 12)) + y[:, None] * np.linspace(0, 1.5, 12)
    clf, report = fit(x, y, model="m", kind="chunks", layers=3, heads=4, card={"note": "synthetic"})
    assert set(report) == {0.001, 0.01, 0.1, 1.0} and clf.card["cv_auroc"] == max(report.values()) > 0.8
    clf.save(tmp_path / "c.json")
    back = FactualityClassifier.load(tmp_path / "c.json")
    np.testing.assert_allclose(back.predict_vectors(x), clf.predict_vectors(x))
    assert auroc(y, back.predict_vectors(x)) > 0.8
    from sklearn.linear_model import LogisticRegression

    ref = LogisticRegression(C=clf.card["C"], max_iter=2000).fit((x - x.mean(0)) / x.std(0), y)
    np.testing.assert_allclose(clf.predict_vectors(x), ref.predict_proba((x - x.mean(0)) / x.std(0))[:, 1],
                               atol=1e-6)
    with pytest.raises(ValueError, match="all the same"):
        fit(x, np.ones(300), model="m", kind="chunks", layers=3, heads=4, card={})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot load"):
        FactualityClassifier.load(tmp_path / "bad.json")


def test_stacked_score_keeps_a_strong_extra_feature_that_appending_dilutes():
    """Many weak block features plus one strong extra score (as the lookback ratios and the log-probability are):
    on held-out data the stacked score beats each input alone, where appending the extra score as one more block
    feature can fall below the extra score by itself."""
    pytest.importorskip("sklearn")
    from certrag.train.factuality import auroc, fit_stacked

    rng = np.random.default_rng(7)

    def draw(n):
        y = rng.integers(0, 2, n)
        block = rng.normal(size=(n, 200)) + y[:, None] * 0.06  # weak, spread over 200 features
        extra = rng.normal(size=n) + y * 1.2  # one strong score, independent of the block's noise
        return block, extra, y

    xb, xe, y = draw(800)
    tb, te, ty = draw(2000)
    st = fit_stacked(xb, xe, y, model="m", kind="chunks", layers=0, heads=0, card={})
    stacked = auroc(ty, st.predict_vectors(tb, te))
    extra_alone = auroc(ty, te)
    block_alone = auroc(ty, st.decision(tb))
    assert stacked > extra_alone + 0.01 and stacked > block_alone + 0.01, (stacked, extra_alone, block_alone)
    assert st.stack.coef[1] > 0 and st.stack.coef[0] > 0 and 0.5 < st.card["cv_auroc"] <= 1
    with pytest.raises(ValueError, match="extra"):
        fit_stacked(xb, xe[:10], y, model="m", kind="chunks", layers=0, heads=0, card={})


def test_engine_answers_for_the_classifier_carry_the_fused_score(tmp_path, smollm):
    """collect_engine answers from the engine's own selection; its reranker baseline is the best *fused* score of
    the selected passages (what the engine ranks by), and the combined features append the mean log-probability."""
    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import QAItem
    from certrag.engine import Engine
    from certrag.rerank import CrossEncoderReranker
    from certrag.train.factuality import collect_engine, combined_features

    rows = wiki_leads()[:20]
    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in rows]
    items = [QAItem(question=f"What is {t}?", answers=(t,), title=t, passage=x)
             for t, x, _ in rows[:2]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=4, rerank=True))
    with Engine.build(docs, tmp_path / "s", config, reranker=CrossEncoderReranker.default(), progress=False) as e:
        data = collect_engine(e, smollm, items, max_new_tokens=6, progress=False)
        for i, it in enumerate(items):
            r = e.retrieve(it.question)
            assert data["top_rerank"][i] == pytest.approx(float(r.rerank_scores[: r.selected].max()), abs=1e-4)
            assert data["with_gold"][i] == int(it.gold_text in r.selected_texts)
    x = combined_features(data)
    assert x.shape == (2, data["chunks"].shape[1] + 1)
    np.testing.assert_array_equal(x[:, -1], data["mean_logprob"])


def test_the_classifier_to_ship_is_chosen_on_train_and_round_trips(tmp_path):
    """choose() ships the stacked lookback model where its ratios add to the log-probability, and the calibrated
    log-probability where they are noise; either saves and loads back to the same predictions."""
    pytest.importorskip("sklearn")
    from certrag.certify.factuality import FactualityClassifier
    from certrag.train.factuality import choose

    rng = np.random.default_rng(11)

    def draw(n, signal):
        y = rng.integers(0, 2, n)
        full = rng.normal(size=(n, 24)) + y[:, None] * signal
        return {"label": y, "mean_logprob": rng.normal(size=n) + y * 0.8, "full": full,
                "chunks": rng.normal(size=(n, 24))}

    for signal, want in ((0.5, "full"), (0.0, "logprob")):
        train = draw(800, signal)
        clf, report = choose(train, model="m", layers=4, heads=6, card={"data": "synthetic"})
        assert clf.kind == want and set(report) == {"logprob", "full", "chunks"}, report
        assert (clf.stack is not None) == (want != "logprob") and clf.card["cv_auroc_by_candidate"] == report
        clf.save(tmp_path / f"{want}.json")
        back = FactualityClassifier.load(tmp_path / f"{want}.json")
        x = train["mean_logprob"][:, None] if want == "logprob" else train[want]
        extra = None if want == "logprob" else train["mean_logprob"]
        np.testing.assert_allclose(back.predict_vectors(x, extra), clf.predict_vectors(x, extra))
    with pytest.raises(ValueError, match="kind"):
        FactualityClassifier(model="m", kind="attention", layers=0, heads=0, mean=np.zeros(1), scale=np.ones(1),
                             coef=np.ones(1), intercept=0.0, card={})


def test_the_shipped_classifier_states_what_it_predicts_and_how_it_was_chosen():
    """Every classifier in the package loads, names its label, and carries a card with its data, features, the
    choice made on train, a remake command and -- for each held-out set -- its AUROC beside the free baseline's."""
    from certrag.certify.factuality import LABEL, PACKAGE_DIR, FactualityClassifier, has_classifier

    shipped = sorted(PACKAGE_DIR.glob("*.json"))
    assert shipped and has_classifier("qwen2.5-coder-0.5b-instruct") and not has_classifier("smollm2-135m-instruct")
    for path in shipped:
        clf = FactualityClassifier.for_model(path.stem)
        assert clf.model == path.stem and "correct" in LABEL
        card = clf.card
        for key in ("data", "label", "features", "chosen", "remake", "heldout", "cv_auroc_by_candidate"):
            assert card.get(key), (path.name, key)
        # chosen on train (its engine answers, where the card says so), never below the log-probability there
        assert card.get("cv_auroc_judged", card["cv_auroc"]) >= card["cv_auroc_by_candidate"]["logprob"]
        for name, h in card["heldout"].items():
            assert 0.5 < h["auroc"] <= 1 and 0.5 < h["logprob_auroc"] <= 1 and h["n"] >= 100, name
            assert h["gain"] == pytest.approx(h["auroc"] - h["logprob_auroc"], abs=2e-4)
        n = clf.layers * clf.heads if clf.needs_lookback else 1
        assert clf.mean.shape == clf.scale.shape == clf.coef.shape == (n,)


def test_answer_signals_are_the_answers_token_statistics_and_its_passages_best_score():
    from certrag.certify.factuality import SIGNALS, answer_signals

    s = answer_signals([-0.5, -2.0, -0.1], [3.0, np.nan, 7.5])
    assert set(s) == set(SIGNALS)
    assert s["mean_logprob"] == pytest.approx(-2.6 / 3) and s["min_logprob"] == -2.0
    assert s["first_logprob"] == -0.5 and s["top_rerank"] == 7.5
    assert np.isnan(s["support"])  # no text, no passages: unknown, not zero
    empty = answer_signals([], [np.nan, np.nan])  # nothing generated, passages not reranked
    assert all(np.isnan(v) for v in empty.values())


def test_an_answers_support_is_the_largest_share_of_its_words_one_passage_holds():
    """Words are compared as the label compares answers (DPR normalisation: case, punctuation and articles
    ignored); the share is taken per passage, so words scattered over two passages do not add up."""
    from certrag.certify.factuality import answer_signals, answer_support

    passages = ["The Eiffel Tower is in Paris, France.", "It was completed in 1889 by Gustave Eiffel's company."]
    assert answer_support("Paris", passages) == 1.0
    assert answer_support("the PARIS!", passages) == 1.0  # article, case and punctuation as the label ignores
    assert answer_support("Paris 1889", passages) == 0.5  # each word in a different passage: half in the best one
    assert answer_support("completed in 1889", passages) == 1.0
    assert answer_support("Lyon", passages) == 0.0 and answer_support("unknown", passages) == 0.0
    assert answer_support("", passages) == 0.0 and answer_support("Paris", []) == 0.0
    assert answer_support("Paris", ["Parisian food"]) == 0.0  # whole words, not substrings
    s = answer_signals([-0.2, -0.4], [1.0], answer="Rome, Paris", passages=passages)
    assert s["support"] == 0.5


def _signal_draw(rng, n, block, rerank):
    """Synthetic answers: a lookback block of 24 ratios carrying `block` of the label, the mean log-probability
    carrying some, the passages' best reranker score carrying `rerank` (independent of the rest)."""
    y = rng.integers(0, 2, n)
    return {"label": y, "full": rng.normal(size=(n, 24)) + y[:, None] * block,
            "chunks": rng.normal(size=(n, 24)), "mean_logprob": rng.normal(size=n) + y * 0.8,
            "min_logprob": rng.normal(size=n) - 3.0, "first_logprob": rng.normal(size=n) - 1.0,
            "top_rerank": rng.normal(size=n) * 2 + 10 + y * 2.0 * rerank}


def test_the_free_signals_join_the_stack_when_they_add_to_it(tmp_path):
    """choose() offers the stacks over all the free signals and a regression on the signals alone: where the best
    reranker score carries what neither the ratios nor the log-probability do, the chosen model reads it and ranks
    held-out answers better than the stack over the mean log-probability alone; where the signals are noise, the
    earlier choice stands. Every choice saves and loads back to the same predictions, its inputs named."""
    pytest.importorskip("sklearn")
    from certrag.certify.factuality import SIGNALS, FactualityClassifier
    from certrag.train.factuality import auroc, choose, signal_matrix

    rng = np.random.default_rng(5)
    for block, rerank, want in ((0.15, 1.0, "full"), (0.0, 1.0, "signals"), (0.15, 0.0, "full")):
        train, test = _signal_draw(rng, 800, block, rerank), _signal_draw(rng, 3000, block, rerank)
        clf, report = choose(train, model="m", layers=4, heads=6, card={})
        assert set(report) == {"logprob", "signals", "full", "chunks", "full+signals", "chunks+signals"}
        assert clf.kind == want, report
        if rerank:
            assert "top_rerank" in clf.signals, report
        clf.save(tmp_path / "c.json")
        back = FactualityClassifier.load(tmp_path / "c.json")
        assert back.signals == clf.signals and back.to_dict() == clf.to_dict()
        e = signal_matrix(test, clf.signals)
        x, extra = (e, None) if clf.kind == "signals" else (test["full"], e)
        got = back.predict_vectors(x, extra)
        np.testing.assert_allclose(got, clf.predict_vectors(x, extra))
        if rerank:  # the reranker score is worth its place on held-out answers
            lp_only = choose({k: v for k, v in train.items() if k not in SIGNALS[1:]}, model="m", layers=4,
                             heads=6, card={})[0]
            base = lp_only.predict_vectors(test["full"], test["mean_logprob"]) if lp_only.stack else \
                lp_only.predict_vectors(test["mean_logprob"][:, None])
            assert auroc(test["label"], got) > auroc(test["label"], base) + 0.02
        # one answer at a time, by name, as the engine calls it: the same probability
        row = {k: float(test[k][0]) for k in SIGNALS if k in test}
        one = clf.predict(None, signals=row) if clf.kind == "signals" else None
        if one is not None:
            assert one == pytest.approx(got[0], rel=1e-9)
            assert np.isnan(clf.predict(None, signals={**row, "top_rerank": np.nan}))


def test_a_version_2_classifier_file_still_loads_and_predicts_the_same(tmp_path):
    """Shipped classifiers written before the free signals (version 2, a stack over the mean log-probability) load
    with that stack's meaning."""
    import json

    from certrag.certify.factuality import FactualityClassifier, Stack

    clf = FactualityClassifier(model="m", kind="full", layers=1, heads=3, mean=np.zeros(3), scale=np.ones(3),
                               coef=np.array([0.5, -0.2, 0.1]), intercept=0.3, card={},
                               stack=Stack(mean=np.array([0.1, -1.0]), scale=np.array([1.2, 0.4]),
                                           coef=np.array([0.8, 1.1]), intercept=-0.1))
    d = clf.to_dict()
    d["version"] = 2
    del d["inputs"], d["stack"]["inputs"]
    (tmp_path / "v2.json").write_text(json.dumps(d))
    back = FactualityClassifier.load(tmp_path / "v2.json")
    assert back.stack.inputs == ("mean_logprob",) and back.signals == ("mean_logprob",)
    x = np.random.default_rng(0).normal(size=(5, 3))
    lp = np.linspace(-2, 0, 5)
    z = np.column_stack([x @ clf.coef + 0.3, lp])
    want = 1 / (1 + np.exp(-(((z - [0.1, -1.0]) / [1.2, 0.4]) @ [0.8, 1.1] - 0.1)))
    np.testing.assert_allclose(back.predict_vectors(x, lp), want)
    with pytest.raises(ValueError, match="stack's inputs"):
        Stack(mean=np.zeros(2), scale=np.ones(2), coef=np.ones(2), intercept=0.0, inputs=("attention",))
    with pytest.raises(ValueError, match="2 inputs"):
        Stack(mean=np.zeros(3), scale=np.ones(3), coef=np.ones(3), intercept=0.0)


def test_a_confidence_that_reads_the_reranker_score_has_one_when_the_reranker_was_skipped(tmp_path, smollm):
    """A classifier over the free signals reads the best fused reranker score of the passages the reader was given;
    with reranking skipped for the question (rerank=False, the adaptive rule) the engine scores those passages, so
    the answer still has its P(correct), equal to the formula over an independent reranked retrieval's scores of
    the same chunks and over the answer's support counted by hand in the passages it read."""
    from certrag.certify.factuality import SIGNALS, FactualityClassifier
    from certrag.config import EngineConfig, RetrievalConfig, SelectionConfig
    from certrag.data.corpora import wiki_leads
    from certrag.engine import Engine
    from certrag.llm.prompts import Passage, plain_messages
    from certrag.rerank import CrossEncoderReranker

    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:15]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=4),
                          selection=SelectionConfig(method="topk", k=2))
    from certrag.eval.metrics import normalize_answer

    coef = np.array([1.5, 0.3, 0.2, 0.4, 2.5])
    clf = FactualityClassifier(model="smollm2-135m-instruct", kind="signals", layers=0, heads=0,
                               mean=np.array([-1.0, -3.0, -1.0, 10.0, 0.5]),
                               scale=np.array([0.5, 1.0, 1.0, 2.0, 0.3]), coef=coef, intercept=0.2, card={},
                               inputs=SIGNALS)
    question = f"What is {docs[3]['id'][5:]}?"
    with Engine.build(docs, tmp_path / "s", config, reranker=CrossEncoderReranker.default(), progress=False) as e:
        e.llm, e.factuality = smollm, clf
        dense = e.retrieve(question, rerank=False)  # as the adaptive rule leaves a question it skips
        a = e.answer(question, retrieval=dense, confidence=True, max_new_tokens=8)
        assert np.isnan(a.retrieval.rerank_scores).all()  # the answer was made from the dense ranking
        reranked = e.retrieve(question, rerank=True, candidates=len(dense.chunk_ids))
    fused = dict(zip(reranked.chunk_ids.tolist(), reranked.rerank_scores.tolist()))
    top = max(fused[int(c)] for c in a.retrieval.selected_chunk_ids)
    passages = [Passage(t, chunk_id=int(c)) for t, c in zip(a.retrieval.selected_texts,
                                                           a.retrieval.selected_chunk_ids)]
    g = smollm.generate(plain_messages(question, passages), max_new_tokens=8)
    lps = list(g.token_logprobs)
    assert g.text == a.text
    words = normalize_answer(g.text).split()
    support = max(sum(w in normalize_answer(t).split() for w in words) / len(words)
                  for t in a.retrieval.selected_texts) if words else 0.0
    row = np.array([g.mean_logprob, min(lps), lps[0], top, support])
    want = 1 / (1 + np.exp(-(((row - clf.mean) / clf.scale) @ coef + 0.2)))
    assert a.p_correct == pytest.approx(want, rel=1e-4)


def test_the_choice_is_weighed_on_the_answers_judge_names():
    """Training answers of two kinds: protocol ones, where the lookback ratios carry the label, and the engine's,
    where they are noise and the log-probability alone carries it. Weighed on all of them the stacked lookback
    model wins; weighed on the engine answers (judge) -- the ones met at run time -- the calibrated log-probability
    does, and the report holds the engine answers' out-of-fold AUROCs (the log-probability's is its raw AUROC
    there, up to the folds' calibration)."""
    pytest.importorskip("sklearn")
    from certrag.train.factuality import auroc, carried_signals, choose

    rng = np.random.default_rng(2)
    n = 900
    y = rng.integers(0, 2, 2 * n)
    engine = np.arange(2 * n) >= n
    full = rng.normal(size=(2 * n, 24))
    full[~engine] += y[~engine, None] * 0.5
    train = {"label": y, "full": full, "chunks": rng.normal(size=(2 * n, 24)),
             "mean_logprob": rng.normal(size=2 * n) + y * 0.8}
    assert carried_signals(train) == ("mean_logprob",)
    pooled, _ = choose(train, model="m", layers=4, heads=6, card={})
    judged, report = choose(train, model="m", layers=4, heads=6, card={}, judge=engine)
    assert pooled.kind == "full" and pooled.card["chosen_on"] == "train"
    assert judged.kind == "logprob" and judged.card["chosen_on"] == "train's engine answers", report
    assert report["logprob"] == pytest.approx(auroc(y[engine], train["mean_logprob"][engine]), abs=0.01)
    assert report["full"] < report["logprob"] + 0.01
    with pytest.raises(ValueError, match="judge"):
        choose(train, model="m", layers=4, heads=6, card={}, judge=engine & (y == 1))


def test_a_signal_is_carried_unless_the_answers_never_recorded_it():
    """carried_signals: a column missing or all NaN (a set made before the signal existed) is not carried; one a few
    answers lack (an empty answer has no log-probability) is, in SIGNALS' order."""
    from certrag.train.factuality import carried_signals

    n = 6
    lp = np.linspace(-2, 0, n)
    lp[2] = np.nan
    train = {"label": np.arange(n) % 2, "mean_logprob": lp, "support": np.full(n, np.nan),
             "top_rerank": np.arange(n, dtype=float)}
    assert carried_signals(train) == ("mean_logprob", "top_rerank")
    assert carried_signals({**train, "top_rerank": np.arange(n - 1, dtype=float)}) == ("mean_logprob",)
