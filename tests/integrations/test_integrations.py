"""The adapters against the real frameworks (LangChain, LlamaIndex, Haystack), each checked against the engine's
own retrieval on the same store; skipped only where the framework is not installed (`pip install
'certrag[langchain,llama-index,haystack]'`)."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")

from certrag.config import EngineConfig, RetrievalConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402

QUESTION = "an ancient Greek epic poem about a journey"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from certrag.data.corpora import wiki_leads

    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:30]]
    config = EngineConfig(chunker="fixed_sentence", encoder_backend="float32",
                          retrieval=RetrievalConfig(candidates=8))
    e = Engine.build(docs, tmp_path_factory.mktemp("integrations") / "s", config, progress=False)
    yield e
    e.close()


def _check(engine, texts, metas, scores=None):
    want = engine.retrieve(QUESTION)
    assert texts == list(want.texts[: want.selected])
    assert [m["chunk_id"] for m in metas] == want.chunk_ids[: want.selected].tolist()
    assert all(m["selected"] for m in metas)
    np.testing.assert_allclose([m["rerank_score"] for m in metas], want.rerank_scores[: want.selected], atol=1e-5)
    if scores is not None:
        np.testing.assert_allclose(scores, want.rerank_scores[: want.selected], atol=1e-5)


def test_langchain_retriever(engine):
    pytest.importorskip("langchain_core")
    from certrag.integrations.langchain import CertragRetriever

    retriever = CertragRetriever(engine=engine)
    docs = retriever.invoke(QUESTION)
    _check(engine, [d.page_content for d in docs], [d.metadata for d in docs])
    again = asyncio.run(retriever.ainvoke(QUESTION))
    assert [d.metadata["chunk_id"] for d in again] == [d.metadata["chunk_id"] for d in docs]
    every = CertragRetriever(engine=engine, include_unselected=True).invoke(QUESTION)
    assert len(every) == 8 and [d.metadata["selected"] for d in every].count(True) == len(docs)
    from certrag.certify.conformal import CalibrationError

    with pytest.raises(CalibrationError, match="no calibration"):  # asked to certify without one: said, not hidden
        CertragRetriever(engine=engine, certify=True).invoke(QUESTION)


def test_llama_index_retriever_and_postprocessor(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    from certrag.integrations.llama_index import CertragPostprocessor, CertragRetriever

    nodes = CertragRetriever(engine).retrieve(QUESTION)
    _check(engine, [n.node.get_content() for n in nodes], [n.node.metadata for n in nodes], [n.score for n in nodes])
    # the postprocessor over someone else's nodes: every candidate, shuffled, with no scores of its own
    r = engine.retrieve(QUESTION)
    foreign = [NodeWithScore(node=TextNode(text=t), score=0.0) for t in reversed(r.texts)]
    kept = CertragPostprocessor(engine=engine).postprocess_nodes(foreign, query_bundle=QueryBundle(QUESTION))
    assert [n.node.get_content() for n in kept] == list(r.texts[: r.selected])
    np.testing.assert_allclose([n.score for n in kept], r.rerank_scores[: r.selected], atol=1e-4)


def test_haystack_component(engine):
    pytest.importorskip("haystack")
    from haystack import Pipeline

    from certrag.integrations.haystack import CertragRetriever

    pipe = Pipeline()
    pipe.add_component("retriever", CertragRetriever(engine))
    docs = pipe.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
    _check(engine, [d.content for d in docs], [d.meta for d in docs], [d.score for d in docs])
