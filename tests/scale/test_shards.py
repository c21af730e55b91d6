"""A store split into HNSW shards: routing by a stable hash, scatter-gather search against brute force, and the
engine over a sharded store against the same corpus unsharded (real embedder, real text)."""

import hashlib
import json

import numpy as np
import pytest

from certrag.index import HnswIndex
from certrag.shards import ShardedIndex, merge_top_k, shard_of


def test_shard_of_is_the_documented_hash_and_spreads_documents():
    for doc_id in ("a", "wiki:Paris", "ünïcode id", ""):
        digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
        assert shard_of(doc_id, 7) == int.from_bytes(digest[:8], "big") % 7
    counts = np.bincount([shard_of(f"doc-{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 900  # 1000 expected per shard
    assert all(shard_of(f"doc-{i}", 1) == 0 for i in range(10))


def test_merge_keeps_the_best_of_every_shard_and_is_sized_like_the_index():
    a = (np.array([[5, 1, -1]]), np.array([[0.9, 0.2, -np.inf]], np.float32))
    b = (np.array([[7, 3, 2]]), np.array([[0.95, 0.5, 0.1]], np.float32))
    merged = merge_top_k([a, b], 4)
    assert merged.ids.tolist() == [[7, 5, 3, 1]]
    assert merged.scores[0].tolist() == pytest.approx([0.95, 0.9, 0.5, 0.2])
    small = merge_top_k([(np.array([[4]]), np.array([[0.3]], np.float32))], 3)
    assert small.ids.tolist() == [[4]] and small.scores.shape == (1, 1)  # min(k, what the shards hold)


def _exact(base, queries, k):
    scores = queries @ base.T
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def test_sharded_search_is_exact_at_full_breadth_and_no_worse_than_one_index(clustered_1001):
    base, queries = clustered_1001
    base = base / np.linalg.norm(base, axis=1, keepdims=True)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    ids = np.arange(len(base), dtype=np.int64)
    doc_ids = [f"doc-{i // 3}" for i in ids]  # three chunks per document: a document's rows share a shard
    sharded = ShardedIndex.empty(3, base.shape[1], "ip", M=8, ef_construction=64)
    sharded.add(base, ids, doc_ids)
    assert len(sharded) == len(base)
    for s, shard in enumerate(sharded.shards):
        assert {doc_ids[i] for i in shard.ids()} <= {d for d in doc_ids if shard_of(d, 3) == s}
    k = 10
    truth = _exact(base, queries, k)
    full = sharded.search(queries, k, ef=len(base))
    assert (full.ids == truth).mean() > 0.999  # ties aside, exact
    one = HnswIndex(base.shape[1], "ip", M=8, ef_construction=64)
    one.add(base, ids)
    recall = {}
    for name, index in (("one", one), ("sharded", sharded)):
        found = index.search(queries, k, ef=16).ids
        recall[name] = np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth)])
    assert recall["sharded"] >= recall["one"] - 0.01
    np.testing.assert_allclose(sharded.get_vectors(ids[[0, 500, 1000]]), base[[0, 500, 1000]], atol=1e-6)
    assert sharded.remove(ids[:30]) == 30 and len(sharded) == len(base) - 30
    with pytest.raises(ValueError, match="already in the index"):
        sharded.add(base[40:41], ids[40:41], ["doc-x"])
    with pytest.raises(ValueError, match="one entry per vector"):
        sharded.add(base[:2], np.array([5000, 5001]), ["d"])


@pytest.fixture(scope="module")
def leads():
    from certrag.data.corpora import wiki_leads

    rows = wiki_leads()[:36]
    return [{"id": f"wiki:{t}", "text": f"{t}\n{x}", "metadata": {"description": d}} for t, x, d in rows]


def test_a_sharded_store_answers_as_the_unsharded_one_and_routes_writes(tmp_path, leads):
    pytest.importorskip("torch")
    from certrag.config import EngineConfig, IndexConfig, RetrievalConfig
    from certrag.engine import Engine
    from certrag.store import StoreError

    plain = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8, rerank=False))
    sharded = plain.replace(index=IndexConfig(shards=3))
    one = Engine.build(leads[:30], tmp_path / "one", plain, progress=False)
    three = Engine.build(leads[:30], tmp_path / "three", sharded, progress=False)
    with one, three:
        assert [c["text"] for c in one._data.chunks] == [c["text"] for c in three._data.chunks]
        np.testing.assert_array_equal(one._data.vectors, three._data.vectors)
        for q in ("the capital of France", "a river in Africa", "a programming language", "a famous painter"):
            a, b = one.retrieve(q), three.retrieve(q)
            assert a.chunk_ids.tolist() == b.chunk_ids.tolist()
            np.testing.assert_allclose(a.dense_scores, b.dense_scores, atol=1e-6)
        live = [len(s) for s in three._data.index.shards]
        gone = leads[0]["id"]
        n_gone = three.remove(gone)
        after = [len(s) for s in three._data.index.shards]
        expect = list(live)
        expect[shard_of(gone, 3)] -= n_gone
        assert after == expect
        three.add(leads[30:33], progress=False)
        for doc in leads[30:33]:
            s = shard_of(doc["id"], 3)
            for cid in three._data.documents[doc["id"]]["chunk_ids"]:
                assert cid in three._data.index.shards[s]
        assert three.info()["index"]["shards"] == 3
    version = next(p for p in (tmp_path / "three").glob("v0*"))
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["index"]["files"] == [f"index-{i:03d}-of-003.hnsw" for i in range(3)]
    for f in manifest["index"]["files"]:
        assert manifest["files"][f]["sha256"] == hashlib.sha256((version / f).read_bytes()).hexdigest()
    reopened = Engine.open(tmp_path / "three", read_only=True)
    assert len(reopened) == sum(manifest["index"]["live"])
    reopened.close()
    damaged = version / "index-001-of-003.hnsw"
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0x01
    damaged.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="index-001-of-003.hnsw fails its checksum"):
        Engine.open(tmp_path / "three", read_only=True)
    with pytest.raises(ValueError, match="index.shards"):
        IndexConfig(shards=0)
