"""Engine add / remove / retrieve / reopen as a hypothesis state machine against a brute-force model (as Chroma tests
its collections). Short by default; CERTRAG_LONG_TESTS=1 runs 60 examples of 15 steps."""

import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule  # noqa: E402


LONG = os.environ.get("CERTRAG_LONG_TESTS") == "1"


def _fast_config():
    from certrag.config import EngineConfig, RetrievalConfig

    return EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8, rerank=False))


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()


class EngineMachine(RuleBasedStateMachine):
    """Engine add / remove / retrieve / reopen against a brute-force model: a dict of documents, and exact cosine
    search over their embeddings (the embedder run directly)."""

    docs = Bundle("docs")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        from certrag.embed import Embedder
        from certrag.engine import Engine

        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "s")
        self.embedder = Embedder.default()
        self.engine = Engine.build([], self.path, _fast_config(), progress=False)
        self.model: dict[str, str] = {}
        self.counter = 0

    @rule(target=docs, words=st.lists(st.sampled_from(WORDS), min_size=2, max_size=8))
    def add(self, words):
        self.counter += 1
        doc_id, text = f"d{self.counter}", " ".join(words) + f" number {self.counter}."
        self.engine.add([{"id": doc_id, "text": text}], progress=False)
        self.model[doc_id] = text
        return doc_id

    @rule(doc_id=consumes(docs))
    def remove(self, doc_id):
        assert self.engine.remove([doc_id]) == 1
        del self.model[doc_id]

    @rule()
    def reopen(self):
        from certrag.engine import Engine

        self.engine.close()
        self.engine = Engine.open(self.path)

    @rule(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))
    def retrieve(self, words):
        from certrag.select import TopKSelector

        if not self.model:
            return
        q = " ".join(words)
        r = self.engine.retrieve(q, candidates=len(self.model) + 5, selector=TopKSelector(k=100))
        assert sorted(r.doc_ids) == sorted(self.model)
        assert {t.strip() for t in r.texts} == {t.strip() for t in self.model.values()}
        truth = self.embedder.embed([self.model[d] for d in r.doc_ids]) @ self.embedder.embed([q])[0]
        np.testing.assert_allclose(r.dense_scores, truth, atol=2e-4)
        assert (np.diff(r.dense_scores) <= 1e-6).all()

    @invariant()
    def documents_match(self):
        assert sorted(self.engine.documents) == sorted(self.model)
        assert len(self.engine) == len(self.model)

    def teardown(self):
        self.engine.close()
        self.dir.cleanup()


def test_engine_state_machine_against_a_brute_force_model():
    from hypothesis import HealthCheck
    from hypothesis.stateful import run_state_machine_as_test

    examples, steps = (60, 15) if LONG else (8, 8)
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, suppress_health_check=list(HealthCheck)))
    print(f"\nengine state machine: {examples} examples of up to {steps} steps, no divergence from the model")
