"""Every implementation of a stage protocol (certrag.protocols) passes the same conformance checks: the declared
fields and methods, and the behaviour the protocol states, against the plain local model as the oracle (a
batching view must give the wrapped model's numbers exactly). The Ray handles are checked for their declared
surface here and for their behaviour live in tests/serve/test_serve.py (the Ray server)."""

import numpy as np
import pytest

from certrag.protocols import LLM, Embedder, LookbackLLM, Reranker, StreamingLLM, TokenLLM, records_lookback, streams

TEXTS = ["Paris is the capital of France.", "The mitochondrion is the powerhouse of the cell.", "Hi"]


@pytest.fixture(scope="module")
def local():
    from certrag.stages import Stages

    return Stages.default()


def _embedders(local):
    from certrag.runtime.batching import BatchingEmbedder

    return {"local": local.embedder, "batching": BatchingEmbedder(local.embedder, max_wait_ms=1.0)}


def _rerankers(local):
    from certrag.runtime.batching import BatchingReranker

    return {"local": local.reranker, "batching": BatchingReranker(local.reranker, max_wait_ms=1.0),
            "batching, 2 instances": BatchingReranker(local.reranker, instances=2, threads=1)}


@pytest.mark.parametrize("kind", ["local", "batching"])
def test_embedders_conform(local, kind):
    e = _embedders(local)[kind]
    assert isinstance(e, Embedder) and isinstance(e.name, str) and e.dim > 0
    v = e.embed(TEXTS)
    assert v.dtype == np.float32 and v.shape == (3, e.dim)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(v, local.embedder.embed(TEXTS))
    counts = e.count_tokens(TEXTS)
    assert counts.tolist() == local.embedder.count_tokens(TEXTS).tolist() and counts[2] < counts[0]


@pytest.mark.parametrize("kind", ["local", "batching", "batching, 2 instances"])
def test_rerankers_conform(local, kind):
    r = _rerankers(local)[kind]
    assert isinstance(r, Reranker) and r.name == local.reranker.name and r.identity == local.reranker.identity
    q = ["what is the capital of france"] * 3
    cross = r.cross_scores(q, TEXTS)
    assert cross.dtype == np.float32 and cross.shape == (3,)
    np.testing.assert_array_equal(cross, local.reranker.cross_scores(q, TEXTS))
    dense = np.array([0.5, 0.1, 0.0], np.float32)
    np.testing.assert_allclose(r.score(q[0], TEXTS, dense), cross + r.dense_weight * dense, rtol=1e-6)
    v = local.embedder.embed([q[0], *TEXTS])
    assert int(np.argmax(r.score(q[0], TEXTS, v[1:] @ v[0]))) == 0  # the fused score ranks the answer first
    with pytest.raises(ValueError):
        r.cross_scores(q, TEXTS[:2])


def test_the_local_llm_and_its_call_view_have_every_capability(smollm):
    from certrag.llm.calls import CallView

    pieces = []
    for llm in (smollm, CallView(smollm, on_text=pieces.append)):
        assert isinstance(llm, (LLM, StreamingLLM, LookbackLLM, TokenLLM))
        assert streams(llm) and records_lookback(llm)
        g = llm.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=4)
        assert g.output_tokens >= 1 and g.text
        ids = llm.prompt_ids([{"role": "user", "content": "Say hello."}])
        p = llm.next_token_probs([ids], [ids[-1]])
        assert p.shape == (1, 1) and 0.0 <= float(p[0, 0]) <= 1.0
    assert "".join(pieces).strip() == g.text


def test_remote_models_declare_the_protocols_they_serve():
    from certrag.llm import OpenAIChatClient
    from certrag.scale.serving import RemoteEmbedder, RemoteLLM, RemoteReranker

    e = RemoteEmbedder(None, {"name": "e", "dim": 4})
    r = RemoteReranker(None, {"name": "r", "dense_weight": 1.0, "skip_rule": None, "card": {}, "identity": {}})
    llm = RemoteLLM(None, {"name": "m", "context_length": 2048, "path": "/nonexistent"})
    assert isinstance(e, Embedder) and isinstance(r, Reranker)
    assert isinstance(llm, StreamingLLM) and streams(llm) and not records_lookback(llm)
    client = OpenAIChatClient("http://127.0.0.1:9", "m")
    assert isinstance(client, LLM) and not streams(client) and not records_lookback(client)
    assert not isinstance(client, TokenLLM)
