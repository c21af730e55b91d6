"""Self-RAG: the reflection scores against the paper's formulas, adaptive retrieval at its threshold, beam search
against brute force, rankings that negative terms cannot invert, and label probabilities against a direct softmax."""

import itertools
import math

import numpy as np
import pytest

from certrag.strategies.self_rag import (Path, Segment, Weights, aggregate_options, beam_search, path_score,
                                        retrieve_probability, s_isrel, s_issup, s_isuse, segment_score,
                                        should_retrieve)


def test_scores_hand_computed():
    probs = {"isrel": {"relevant": 0.3, "irrelevant": 0.1},
             "issup": {"fully": 0.2, "partially": 0.4, "no": 0.2},
             "isuse": {"1": 0.1, "2": 0.0, "3": 0.2, "4": 0.3, "5": 0.4}}
    assert s_isrel(probs) == pytest.approx(0.75)
    assert s_issup(probs) == pytest.approx((0.2 + 0.2) / 0.8)
    assert s_isuse(probs) == pytest.approx((-0.1 + 0 + 0 + 0.15 + 0.4) / 1.0)
    # p(segment) 0.6; weights 1, 1, 0.5; divided by 1 + the weights present (here all: 3.5)
    assert segment_score(0.6, probs) == pytest.approx((0.6 + 0.75 + 0.5 + 0.5 * 0.45) / 3.5)
    assert segment_score(0.6, probs, Weights(rel=2, sup=0, use=-1)) == pytest.approx((0.6 + 1.5 - 0.45) / 4.0)


def test_missing_groups_and_zero_probabilities():
    assert s_isrel({}) is None and s_issup({"isrel": {}}) is None and s_isuse({"isuse": None}) is None
    assert s_isrel({"isrel": {"relevant": 0.0, "irrelevant": 0.0}}) is None
    assert s_isrel({"isrel": {"relevant": 0.0, "irrelevant": 0.5}}) == 0.0
    assert s_issup({"issup": {"partially": 0.3}}) == pytest.approx(0.5)  # absent labels count as probability 0
    assert s_isuse({"isuse": {"5": 1e-30}}) == pytest.approx(1.0)
    # A missing group adds neither its term nor its weight.
    assert segment_score(0.25, {"isrel": {"relevant": 1.0, "irrelevant": 0.0}}) == pytest.approx(1.25 / 2)
    assert segment_score(0.25, {}) == 0.25
    with pytest.raises(ValueError, match="non-negative"):
        s_isrel({"isrel": {"relevant": -0.1, "irrelevant": 0.5}})
    with pytest.raises(ValueError, match="probability"):
        segment_score(1.5, {})


def test_adaptive_retrieval_threshold_at_the_boundary():
    exactly = {"retrieve": {"yes": 0.2, "no": 0.8, "continue": 0.5}}
    assert retrieve_probability(exactly) == 0.2  # 'continue' is not in the ratio
    assert should_retrieve(exactly, 0.2) == (False, 0.2)  # strictly greater than delta
    assert should_retrieve(exactly, math.nextafter(0.2, 0)) == (True, 0.2)
    assert should_retrieve({"retrieve": {"yes": 0.0, "no": 0.0}}, 0.5) == (True, None)  # undefined -> retrieve
    assert should_retrieve({}, 0.9) == (True, None)


def _scripted_tree(seed, branching=3, depth=3):
    rng = np.random.default_rng(seed)
    scores = {}
    for d in range(1, depth + 1):
        for node in itertools.product(range(branching), repeat=d):
            scores[node] = float(rng.normal(0.0, 1.0))

    def expand(path: Path):
        node = tuple(s.passage for s in path.segments)
        if len(node) == depth:
            return []
        return [Segment(text=str(b), passage=b, score=scores[node + (b,)], final=len(node) + 1 == depth)
                for b in range(branching)]

    return scores, expand


def test_beam_search_matches_brute_force_when_wide_and_greedy_when_narrow():
    for seed in range(20):
        scores, expand = _scripted_tree(seed)
        leaves = [n for n in scores if len(n) == 3]
        brute = max(leaves, key=lambda n: path_score([scores[n[:i]] for i in range(1, 4)]))
        best = beam_search(expand, beam_width=27, max_depth=3)[0]
        assert tuple(s.passage for s in best.segments) == brute
        # beam width 1 = greedy on the running mean, computed by hand
        node = ()
        for _ in range(3):
            node = max((node + (b,) for b in range(3)), key=lambda n: path_score([scores[n[:i]]
                                                                                   for i in range(1, len(n) + 1)]))
        assert tuple(s.passage for s in beam_search(expand, beam_width=1, max_depth=3)[0].segments) == node


def test_finished_paths_wait_and_depth_limits():
    def expand(path):
        d = len(path.segments)
        return [Segment("stop", 0, 0.9, final=True), Segment("go", 1, 0.5 - 0.1 * d)]

    pool = beam_search(expand, beam_width=2, max_depth=3)
    assert pool[0].text == "stop" and pool[0].final
    assert all(len(p.segments) <= 3 for p in pool)
    with pytest.raises(ValueError):
        beam_search(expand, beam_width=0)


def test_a_mixed_beam_by_hand():
    """A segment written without retrieval (IsUse only) against one with all three groups, in one beam. By hand:
    no retrieval: p 0.8, IsUse all on 5 (s = 1): (0.8 + 0.5 * 1) / 1.5 = 0.8667.
    retrieved: p 0.7, IsRel 0.9, IsSup fully 0.6 partially 0.4 (s = 0.8), IsUse all on 4 (s = 0.5):
    (0.7 + 0.9 + 0.8 + 0.25) / 3.5 = 0.7571.
    Unnormalised (the old rule) the retrieved one wins 2.65 to 1.3, for having more terms, not for being better."""
    bare = {"isuse": {"5": 1.0}}
    full = {"isrel": {"relevant": 0.9, "irrelevant": 0.1}, "issup": {"fully": 0.6, "partially": 0.4, "no": 0.0},
            "isuse": {"4": 1.0}}
    a, b = segment_score(0.8, bare), segment_score(0.7, full)
    assert a == pytest.approx(1.3 / 1.5) and b == pytest.approx(2.65 / 3.5)
    segs = [Segment("no retrieval", -1, a, final=True), Segment("retrieved", 0, b, final=True)]
    assert [p.text for p in beam_search(lambda p: segs, beam_width=2, max_depth=1)] == ["no retrieval", "retrieved"]


def test_p_segment_covers_only_the_kept_tokens(smollm):
    """The kept segment is the first sentence; its probability is the geometric mean over the tokens that write it,
    read from the generation's per-token log-probabilities (checked here against the tokens decoded by hand)."""
    from certrag.llm.local import Generation
    from certrag.strategies.self_rag import _segment_text, kept_probability

    g = smollm.generate([{"role": "user", "content": "Write two short sentences about Paris."}], max_new_tokens=32)
    assert len(g.token_logprobs) == len(g.token_ids) == g.output_tokens
    assert g.mean_logprob == pytest.approx(sum(g.token_logprobs) / len(g.token_logprobs))
    kept = _segment_text(g.text)
    n = next(i for i in range(1, len(g.token_ids) + 1)
             if len(smollm.tokenizer.decode(list(g.token_ids[:i]), skip_special_tokens=True).strip()) >= len(kept))
    assert kept_probability(g, kept, smollm) == pytest.approx(math.exp(sum(g.token_logprobs[:n]) / n))
    # by hand, on a generation with known log-probabilities: tokens 'A', ' cat', '.', ' More' ...
    tok = smollm.tokenizer
    ids = tok("A cat. More text here.", add_special_tokens=False)["input_ids"]
    fake = Generation(text="A cat. More text here.", input_tokens=1, output_tokens=len(ids), seconds=0.0,
                      finish_reason="stop", token_ids=tuple(ids),
                      token_logprobs=tuple([-0.1, -0.2, -0.3] + [-5.0] * (len(ids) - 3)))
    n_kept = len(tok("A cat.", add_special_tokens=False)["input_ids"])
    assert n_kept == 3  # 'A', ' cat', '.'
    assert kept_probability(fake, "A cat.", smollm) == pytest.approx(math.exp(-0.2))
    # a backend without per-token log-probabilities: the whole generation's mean
    remote = Generation(text="A cat.", input_tokens=1, output_tokens=2, seconds=0.0, finish_reason="stop",
                        mean_logprob=-1.0)
    assert kept_probability(remote, "A cat.", object()) == pytest.approx(math.exp(-1.0))


def test_negative_terms_never_invert_a_ranking():
    # Path A's segments each score above path B's, all negative (w_use = -2 on a useful answer).
    probs_a = {"isuse": {"5": 1.0}, "isrel": {"relevant": 0.9, "irrelevant": 0.1}}
    probs_b = {"isuse": {"5": 1.0}, "isrel": {"relevant": 0.5, "irrelevant": 0.5}}
    w = Weights(rel=1.0, sup=1.0, use=-2.0)
    a = [segment_score(0.3, probs_a, w), segment_score(0.2, probs_a, w)]
    b = [segment_score(0.3, probs_b, w), segment_score(0.2, probs_b, w)]
    assert all(x > y for x, y in zip(a, b)) and all(x < 0 for x in a + b)
    assert path_score(a) > path_score(b)
    assert np.prod(a) < np.prod(b)  # the reference code's product would rank B first
    # Beam search keeps A.
    segs = {(): [Segment("a", 0, a[0]), Segment("b", 1, b[0])], (0,): [Segment("a2", 0, a[1], final=True)],
            (1,): [Segment("b2", 1, b[1], final=True)]}
    best = beam_search(lambda p: segs[tuple(s.passage for s in p.segments)], beam_width=2, max_depth=2)[0]
    assert best.text == "a a2"
    # Closed-set aggregation: monotone in each score, negative or not.
    agg = aggregate_options([0, 1, 1], [-0.5, -3.0, -3.0], 2)
    assert agg[0] > agg[1] > 0
    assert aggregate_options([None, 5], [1.0, 2.0], 2).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------- with real models


def _tiny_llm(tmp_path, extra_tokens=()):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from certrag.llm import LocalLLM
    from certrag.llm.models import BUNDLED_MODELS
    from certrag.llm.weights import q8_cache_dir

    try:
        BUNDLED_MODELS["smollm2-135m-instruct"].gguf_parts()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    tok = AutoTokenizer.from_pretrained(str(q8_cache_dir("smollm2-135m-instruct")), local_files_only=True)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens), special_tokens=False)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return LocalLLM(tmp_path, weights="float32")  # the oracle below runs the same float32 weights


@pytest.mark.parametrize("reflection", [False, True])
def test_label_probabilities_equal_a_direct_softmax(tmp_path, reflection):
    import torch

    from certrag.strategies.self_rag import GROUPS, REFLECTION_TOKENS, Critic

    extra = [t for g in REFLECTION_TOKENS.values() for t in g] if reflection else []
    llm = _tiny_llm(tmp_path, extra)
    critic = Critic(llm)
    assert critic.reflection is reflection
    reqs = [("isrel", critic.prompt("isrel", "who?", "A passage.", "seg")),
            ("issup", critic.prompt("issup", "who wrote the longer question here?", "Another passage, longer.",
                                    "An answer")),
            ("isuse", critic.prompt("isuse", "q", None, "a")),
            ("retrieve", critic.prompt("retrieve", "when?"))]
    assert len({len(ids) for _, ids in reqs}) > 1  # padding is exercised
    got = critic.read(reqs)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    for (group, ids), probs in zip(reqs, got):
        with torch.inference_mode():
            logits = reference(torch.tensor([ids])).logits[0, -1].double()
        direct = torch.softmax(logits, -1)
        want = [float(direct[t]) for t in critic.label_ids[group]]
        np.testing.assert_allclose([probs[group][lab] for lab in GROUPS[group]], want, rtol=1e-4, atol=1e-12)


def test_self_rag_answers_with_the_real_small_model(smollm):
    from certrag.llm.prompts import Passage
    from certrag.strategies.self_rag import SelfRag

    passages = [Passage("The Eiffel Tower is a wrought-iron tower in Paris, France.", chunk_id=11),
                Passage("Bananas are a good source of potassium.", chunk_id=12)]
    res = SelfRag(beam_width=2, max_depth=1, delta=0.0, segment_tokens=16).run("Where is the Eiffel Tower?",
                                                                                passages, smollm)
    segments = [h for h in res.history if "segment" in h]
    assert len(segments) == 2 and {h["passage"] for h in segments} == {0, 1}
    for h in segments:
        assert set(h["probs"]) == {"isrel", "issup", "isuse"} and 0 < h["p_segment"] <= 1
        assert h["score"] == pytest.approx(segment_score(h["p_segment"], h["probs"]))
    chosen = res.history[-1]
    best = max(segments, key=lambda h: h["score"])
    assert chosen["chosen"] == [best["passage"]] and res.cited == (best["passage"],)
    assert res.text == best["segment"] and res.input_tokens > 0
    # Adaptive retrieval off the chart: delta 1 never retrieves, so the one segment has no passage.
    res = SelfRag(max_depth=1, delta=1.0, segment_tokens=8).run("Say hello.", passages, smollm)
    assert [h["passage"] for h in res.history if "segment" in h] == [-1] and res.cited == ()


def test_at_depth_one_a_segment_is_the_whole_generation_and_deeper_it_is_a_sentence(smollm):
    """The paper's short-form setting (max_depth 1): one answer per passage, kept whole and scored on all its tokens;
    a path that may continue keeps one sentence per segment."""
    import math

    from certrag.llm.prompts import Passage
    from certrag.strategies.self_rag import SelfRag

    passages = [Passage("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It "
                        "is named after the engineer Gustave Eiffel, whose company designed and built the tower from "
                        "1887 to 1889.", chunk_id=1)]
    question = "Describe the Eiffel Tower and who built it."
    res = SelfRag(max_depth=1, delta=0.0, segment_tokens=48).run(question, passages, smollm)
    whole = res.calls[res.answer_call].text.strip()
    first = whole.split(". ")[0] + "."
    assert len(first) < len(whole)  # the reader wrote more than one sentence (the case this test is about)
    assert res.text == whole
    lps = res.calls[res.answer_call].token_logprobs
    segment = next(h for h in res.history if "segment" in h)
    assert segment["p_segment"] == pytest.approx(math.exp(sum(lps) / len(lps)), rel=1e-9)

    deeper = SelfRag(max_depth=2, delta=0.0, segment_tokens=48).run(question, passages, smollm)
    first_segments = [h["segment"] for h in deeper.history if h.get("depth") == 0 and "segment" in h]
    assert first_segments == [deeper.calls[0].text.strip().split(". ")[0] + "."]


def test_engine_answer_with_self_rag_cites_the_chosen_passages(tmp_path, smollm):
    from certrag.config import EngineConfig, RetrievalConfig, SelectionConfig
    from certrag.engine import Engine
    from certrag.data.corpora import wiki_leads

    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:20]]
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=4, rerank=False),
                          selection=SelectionConfig(method="topk", k=2))
    with Engine.build(docs, tmp_path / "s", config, progress=False) as engine:
        engine.llm = smollm
        a = engine.answer(f"What is {docs[3]['id'][5:]}?", strategy="self_rag", max_new_tokens=12)
    chosen = a.trace["history"][-1]
    assert a.strategy == "self_rag" and a.text
    assert a.cited_chunk_ids == tuple(int(a.retrieval.chunk_ids[i]) for i in chosen["cited_passages"])
    assert any("p_retrieve" in h for h in a.trace["history"])


def test_deltas_for_rates_make_that_share_of_questions_retrieve(smollm):
    """Self-RAG's default delta 0.2 retrieves for every question with a reader without reflection tokens; the
    deltas chosen for rates 0.75 / 0.5 / 0.25 make about that share retrieve, decided one question at a time by the
    strategy's own rule (should_retrieve on a single read)."""
    from certrag.data.nq import load_nq_open
    from certrag.strategies.self_rag import Critic, deltas_for_rates, should_retrieve

    questions = [it.question for it in load_nq_open(split="train")[:24]]
    rates = (0.75, 0.5, 0.25)
    deltas = deltas_for_rates(smollm, questions, rates)
    assert deltas == sorted(deltas)
    critic = Critic(smollm)
    reads = [critic.retrieve(q) for q in questions]
    for rate, delta in zip(rates, deltas):
        share = np.mean([should_retrieve(r, delta)[0] for r in reads])
        assert abs(share - rate) <= 2 / len(questions) + 1e-9, (rate, delta, share)
    with pytest.raises(ValueError, match="rates"):
        deltas_for_rates(smollm, questions, [1.0])
    with pytest.raises(ValueError, match="questions"):
        deltas_for_rates(smollm, [], [0.5])


class _OneByOne:
    """The same reader without submit or generate_batch: every call generated alone, one after another."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        if name in ("submit", "generate_batch"):
            raise AttributeError(name)
        return getattr(self._llm, name)


class _Recording:
    """The reader, recording when each segment is submitted and when its result is waited for."""

    def __init__(self, llm):
        self._llm, self.events = llm, []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def submit(self, messages, **kwargs):
        pending, i = self._llm.submit(messages, **kwargs), len([e for e in self.events if e[0] == "submit"])
        self.events.append(("submit", i))
        events = self.events

        class _Wait:
            def result(self, timeout=None):
                events.append(("result", i))
                return pending.result(timeout)
        return _Wait()


def test_segments_are_decoded_together_and_match_one_by_one(smollm):
    """Self-RAG writes a segment per passage; they go to the engine together (every segment of a round submitted
    before any is waited for), at both depths (the second continues a prefix), and the search is the same as with
    each segment generated alone: greedy tokens do not depend on their batch companions."""
    from certrag.llm.prompts import Passage
    from certrag.strategies.self_rag import SelfRag

    passages = [Passage("The Eiffel Tower is a wrought-iron tower in Paris, France.", chunk_id=1),
                Passage("Bananas are a good source of potassium.", chunk_id=2),
                Passage("Gustave Eiffel's company built the tower for the 1889 World's Fair.", chunk_id=3)]
    strategy = SelfRag(beam_width=2, max_depth=2, delta=0.0, segment_tokens=10)
    recording = _Recording(smollm)
    together = strategy.run("Where is the Eiffel Tower and who built it?", passages, recording)
    alone = strategy.run("Where is the Eiffel Tower and who built it?", passages, _OneByOne(smollm))

    def segments(r):
        return [(h["depth"], h["passage"], h["segment"], h["p_segment"], h["score"]) for h in r.history
                if "segment" in h]
    assert segments(together) == segments(alone) and together.text == alone.text
    assert [g.token_ids for g in together.calls] == [g.token_ids for g in alone.calls]
    rounds = recording.events
    # every segment went through submit; a round at depth 2 exists (the beam continued a segment)
    assert sum(e[0] == "submit" for e in rounds) == len(segments(together)) > len(passages)
    assert any(h["depth"] == 1 for h in together.history if "segment" in h)
    i = 0  # each round: its submits, then its results
    while i < len(rounds):
        n = 0
        while i < len(rounds) and rounds[i][0] == "submit":
            n, i = n + 1, i + 1
        assert n == len(passages), rounds  # all of the round's segments submitted before the first wait
        assert [e[0] for e in rounds[i:i + n]] == ["result"] * n
        i += n


def test_self_rag_on_an_openai_compatible_server_says_it_needs_a_local_model():
    """Self-RAG reads next-token probabilities (and continues a prefix at depth 2), which a chat-completion server
    does not expose: the strategy refuses before any request, naming what it needs, rather than failing mid-beam."""
    from certrag.llm.openai_client import OpenAIChatClient
    from certrag.llm.prompts import Passage
    from certrag.strategies.self_rag import SelfRag

    client = OpenAIChatClient("http://127.0.0.1:9", "m", retries=0)  # port 9 (discard): any request would fail
    passages = [Passage(text="Paris is the capital of France.", title="France")]
    for depth in (1, 2):
        with pytest.raises(TypeError, match="local model"):
            SelfRag(max_depth=depth).run("What is the capital of France?", passages, client)
