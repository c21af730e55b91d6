"""The adapters against the real frameworks (LangChain, LlamaIndex, Haystack), each checked against the engine's
own retrieval on the same store and used as its framework's docs use a retriever: ids and user metadata back as
indexed, k / top_k / filters honoured, scores where the framework keeps them and out of the LLM's prompt, async,
and (Haystack) a pipeline that saves and loads. Skipped only where the framework is not installed (`pip install
'certrag[langchain,llama-index,haystack]'`)."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")

from certrag.config import EngineConfig, RetrievalConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402
from certrag.select import TopKSelector  # noqa: E402

QUESTION = "an ancient Greek epic poem about a journey"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from certrag.data.corpora import wiki_leads

    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}", "metadata": {"lang": "fr" if i % 3 == 0 else "en", "n": i}}
            for i, (t, x, _) in enumerate(wiki_leads()[:30])]
    config = EngineConfig(chunker="fixed_sentence", encoder_backend="float32",
                          retrieval=RetrievalConfig(candidates=8))
    e = Engine.build(docs, tmp_path_factory.mktemp("integrations") / "s", config, progress=False)
    yield e
    e.close()


def _check(engine, texts, ids, metas, scores=None, **retrieve):
    """The adapter's output against engine.retrieve(QUESTION, **retrieve): the kept chunks in order, their document
    ids and own metadata, and the fused scores."""
    want = engine.retrieve(QUESTION, **retrieve)
    n = want.selected
    assert texts == list(want.texts[:n]) and ids == list(want.doc_ids[:n])
    assert [m["certrag"]["chunk_id"] for m in metas] == want.chunk_ids[:n].tolist()
    assert all(m["certrag"]["selected"] for m in metas)
    assert [{k: m[k] for k in ("lang", "n")} for m in metas] == [engine.metadata(d) for d in want.doc_ids[:n]]
    np.testing.assert_allclose([m["certrag"]["rerank_score"] for m in metas], want.rerank_scores[:n], atol=1e-5)
    if scores is not None:
        np.testing.assert_allclose(scores, want.rerank_scores[:n], atol=1e-5)
    return want


def test_langchain_retriever(engine):
    pytest.importorskip("langchain_core")
    from certrag.integrations.langchain import CertragRetriever

    retriever = CertragRetriever(engine=engine)
    docs = retriever.invoke(QUESTION)
    _check(engine, [d.page_content for d in docs], [d.id for d in docs], [d.metadata for d in docs])
    again = asyncio.run(retriever.ainvoke(QUESTION))
    assert [d.metadata["certrag"]["chunk_id"] for d in again] == [d.metadata["certrag"]["chunk_id"] for d in docs]
    three = retriever.invoke(QUESTION, k=3)  # was silently ignored
    _check(engine, [d.page_content for d in three], [d.id for d in three], [d.metadata for d in three],
           selector=TopKSelector(k=3))
    assert len(three) == 3
    french = retriever.invoke(QUESTION, filter={"lang": "fr"})
    assert french and all(d.metadata["lang"] == "fr" for d in french)
    _check(engine, [d.page_content for d in french], [d.id for d in french], [d.metadata for d in french],
           where={"lang": "fr"})
    every = CertragRetriever(engine=engine, include_unselected=True).invoke(QUESTION)
    assert len(every) == 8 and [d.metadata["certrag"]["selected"] for d in every].count(True) == len(docs)
    # a store without a calibration of its own certifies with the shipped NQ-open one, and says so
    certified = CertragRetriever(engine=engine, certify=True).invoke(QUESTION)
    assert all("not on this store" in d.metadata["certrag"]["certification_reason"] for d in certified)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        retriever.invoke(QUESTION, k=0)


def test_llama_index_retriever_and_postprocessor(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
    from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

    from certrag.integrations.llama_index import CertragPostprocessor, CertragRetriever

    nodes = CertragRetriever(engine).retrieve(QUESTION)
    _check(engine, [n.node.get_content() for n in nodes], [n.node.ref_doc_id for n in nodes],
           [n.node.metadata for n in nodes], [n.score for n in nodes])
    prompt = nodes[0].node.get_content(metadata_mode=MetadataMode.LLM)
    assert "lang: " in prompt and "dense_score" not in prompt and "certrag" not in prompt  # evidence kept out
    assert "certrag" not in nodes[0].node.get_content(metadata_mode=MetadataMode.EMBED)
    top = CertragRetriever(engine, similarity_top_k=3).retrieve(QUESTION)
    _check(engine, [n.node.get_content() for n in top], [n.node.ref_doc_id for n in top],
           [n.node.metadata for n in top], [n.score for n in top], selector=TopKSelector(k=3))
    filters = MetadataFilters(filters=[MetadataFilter(key="lang", value="fr", operator=FilterOperator.EQ)])
    french = asyncio.run(CertragRetriever(engine, filters=filters).aretrieve(QUESTION))
    _check(engine, [n.node.get_content() for n in french], [n.node.ref_doc_id for n in french],
           [n.node.metadata for n in french], where={"lang": "fr"})
    with pytest.raises(ValueError, match="EQ and IN"):
        CertragRetriever(engine, filters=MetadataFilters(filters=[MetadataFilter(key="n", value=3,
                                                                                 operator=FilterOperator.GT)]))
    # the postprocessor over someone else's nodes: every candidate, shuffled, with no scores of its own
    r = engine.retrieve(QUESTION)
    foreign = [NodeWithScore(node=TextNode(text=t), score=0.0) for t in reversed(r.texts)]
    kept = CertragPostprocessor(engine=engine).postprocess_nodes(foreign, query_bundle=QueryBundle(QUESTION))
    assert [n.node.get_content() for n in kept] == list(r.texts[: r.selected])
    np.testing.assert_allclose([n.score for n in kept], r.rerank_scores[: r.selected], atol=1e-4)
    assert "dense_score" not in kept[0].node.get_content(metadata_mode=MetadataMode.LLM)


def test_haystack_component(engine):
    pytest.importorskip("haystack")
    from haystack import Pipeline

    from certrag.integrations.haystack import CertragRetriever

    pipe = Pipeline()
    pipe.add_component("retriever", CertragRetriever(engine))
    docs = pipe.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
    _check(engine, [d.content for d in docs], [d.meta["source_id"] for d in docs], [d.meta for d in docs],
           [d.score for d in docs])
    assert len({d.id for d in docs}) == len(docs)  # unique ids, as Haystack's joiners expect
    top = pipe.run({"retriever": {"query": QUESTION, "top_k": 3, "filters": {
        "field": "meta.lang", "operator": "==", "value": "en"}}})["retriever"]["documents"]
    _check(engine, [d.content for d in top], [d.meta["source_id"] for d in top], [d.meta for d in top],
           [d.score for d in top], selector=TopKSelector(k=3), where={"lang": "en"})
    # the pipeline saves as the store's path and options, and loads back to the same answers
    loaded = Pipeline.loads(pipe.dumps(), allowed_modules=["certrag.integrations.haystack"])  # Haystack's allowlist
    again = loaded.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
    assert [d.id for d in again] == [d.id for d in docs]
    assert str(engine.path.resolve()) in pipe.dumps()
    two = CertragRetriever(engine, top_k=2)
    out = asyncio.run(two.run_async(QUESTION))
    assert [d.id for d in out["documents"]] == [d.id for d in two.run(QUESTION)["documents"]]
    assert len(out["documents"]) == 2
    with pytest.raises(ValueError, match="supports"):
        CertragRetriever(engine, filters={"field": "meta.n", "operator": ">", "value": 3})
