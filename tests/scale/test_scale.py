"""certrag on Ray, on a local Ray cluster started in this process (ray.init(num_cpus=2); no network): indexing as a
Ray Data job against the local build of the same corpus (the oracle), a worker killed mid-job, a failed job that
must leave nothing behind, and a sharded store served by shard actors against the same store in this process. The
HTTP suite against Ray Serve is tests/serve/test_serve.py's (its server fixture runs both ways)."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from certrag.config import IndexConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402
from certrag.store import StoreError  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray cluster

QUESTIONS = ("the capital of France", "a river in Africa", "a programming language", "a famous painter",
             "a war in Europe")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 64 documents three ways: JSONL, a folder of text files, and Parquet (metadata as a struct)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from certrag.data.corpora import wiki_leads

    rows = wiki_leads()[:64]
    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}", "metadata": {"description": d}} for t, x, d in rows]
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "a.jsonl", "w") as f:
        for d in docs[:24]:
            f.write(json.dumps(d) + "\n")
    (root / "texts").mkdir()
    for i, d in enumerate(docs[24:44]):
        (root / "texts" / f"doc{i:02d}.txt").write_text(d["text"])
    pq.write_table(pa.Table.from_pylist(docs[44:]), root / "c.parquet")
    (root / "bad.jsonl").write_text(json.dumps(docs[0]) + "\n{not json\n")
    return root


def _sources(root):
    return [root / "a.jsonl", root / "texts", root / "c.parquet"]


def _same_store(a: Engine, b: Engine) -> None:
    assert a._data.chunks == b._data.chunks  # ids, document ids, offsets, token counts and texts
    assert a._data.documents == b._data.documents
    np.testing.assert_allclose(a._data.vectors, b._data.vectors, atol=1e-6)
    for q in QUESTIONS:
        ra, rb = a.retrieve(q), b.retrieve(q)
        assert ra.chunk_ids.tolist() == rb.chunk_ids.tolist()
        np.testing.assert_allclose(ra.dense_scores, rb.dense_scores, atol=1e-5)


@pytest.fixture(scope="module")
def local_build(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "store"
    engine = Engine.build(_sources(corpus), path, FAST.replace(index=IndexConfig(shards=2)), progress=False)
    yield engine
    engine.close()


def test_ray_data_build_equals_the_local_build(cluster, corpus, local_build, tmp_path):
    from certrag.scale import index_on_ray

    with index_on_ray(_sources(corpus), tmp_path / "ray", FAST.replace(index=IndexConfig(shards=2)), workers=2,
                      batch_docs=8, progress=False) as engine:
        assert engine.build_report.documents == 64
        _same_store(local_build, engine)
        assert [len(s) for s in engine._data.index.shards] == [len(s) for s in local_build._data.index.shards]
    # adding through Ray to an existing store gives what adding locally gives
    extra = [{"id": "new:1", "text": "A new document about the moons of Jupiter and their orbits."}]
    with index_on_ray(extra, tmp_path / "ray", progress=False) as engine:
        assert engine.build_report.documents == 1 and "new:1" in engine.documents
        assert engine.retrieve("moons of Jupiter").doc_ids[0] == "new:1"


def _map_workers() -> list[int]:
    """Pids of the Ray Data actors running SegmentEmbedWorker (Ray names its processes after the actor)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "SegmentEmbedWorker" in cmd and "MapWorker" in cmd:
                pids.append(int(entry.name))
    return pids


def test_a_worker_killed_mid_job_is_retried_and_the_store_is_whole(cluster, corpus, local_build, tmp_path):
    from certrag.scale import index_on_ray

    result, errors = {}, []

    def build():
        try:
            result["engine"] = index_on_ray(_sources(corpus), tmp_path / "killed",
                                            FAST.replace(index=IndexConfig(shards=2)), workers=2, batch_docs=2,
                                            progress=False)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    job = threading.Thread(target=build)
    job.start()
    # Kill a map worker that has been up long enough to load its models and take a batch. The listing is re-read
    # each round: Ray may retire or replace an actor between two looks, and a pid that is already gone is no victim.
    deadline, first_seen, victim = time.time() + 120, {}, None
    while time.time() < deadline and victim is None and job.is_alive():
        now = time.time()
        for pid in _map_workers():
            first_seen.setdefault(pid, now)
            if now - first_seen[pid] >= 2.5:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                victim = pid
                break
        time.sleep(0.1)
    assert victim is not None, "the job ended before a worker could be killed"
    job.join(timeout=300)
    assert not errors, errors
    with result["engine"] as engine:
        _same_store(local_build, engine)
    assert not Path(f"/proc/{victim}").exists()


def test_a_failed_job_leaves_no_store_and_an_existing_store_unchanged(cluster, corpus, tmp_path):
    from certrag.scale import index_on_ray

    with pytest.raises(Exception, match="not valid JSON"):
        index_on_ray([corpus / "bad.jsonl"], tmp_path / "new", FAST, progress=False)
    assert not (tmp_path / "new").exists()
    with Engine.build([corpus / "a.jsonl"], tmp_path / "old", FAST, progress=False):  # (a Ray build costs 20 s more)
        pass
    before = (tmp_path / "old" / "CURRENT").read_text()
    with pytest.raises(Exception, match="not valid JSON"):
        index_on_ray([corpus / "texts", corpus / "bad.jsonl"], tmp_path / "old", progress=False)
    assert (tmp_path / "old" / "CURRENT").read_text() == before
    with Engine.open(tmp_path / "old", read_only=True) as engine:
        assert len(engine.documents) == 24
    with pytest.raises(ValueError, match="workers"):
        index_on_ray([corpus / "a.jsonl"], tmp_path / "x", FAST, workers=0)


def test_shard_actors_serve_the_store_as_this_process_does(cluster, local_build):
    with Engine.open(local_build.path, read_only=True, shard_actors=True) as engine:
        assert type(engine._data.index).__name__ == "RayShardedIndex"
        assert len(engine) == len(local_build)
        assert engine.info()["index"]["shards"] == 2
        for q in QUESTIONS:
            a, b = local_build.retrieve(q), engine.retrieve(q)
            assert a.chunk_ids.tolist() == b.chunk_ids.tolist()
        ids = local_build._data.ids[[0, 7, 40]]
        np.testing.assert_allclose(engine._data.index.get_vectors(ids), local_build._data.vectors[[0, 7, 40]],
                                   atol=1e-6)
        engine._data.index.close()
    with pytest.raises(ValueError, match="read_only"):
        Engine.open(local_build.path, shard_actors=True)


def test_cli_index_on_ray_with_shards(cluster, corpus, tmp_path):
    from click.testing import CliRunner

    from certrag.cli import main

    out = CliRunner().invoke(main, ["index", str(corpus / "a.jsonl"), "--store", str(tmp_path / "s"), "--ray",
                                    "--workers", "1", "--shards", "3", "--chunker", "fixed_sentence", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["documents"] == 24
    with Engine.open(tmp_path / "s", read_only=True) as engine:
        assert engine.config.index.shards == 3 and len(engine._data.index.shards) == 3
    again = CliRunner().invoke(main, ["index", str(corpus / "a.jsonl"), "--store", str(tmp_path / "s"),
                                      "--shards", "2"])
    assert again.exit_code != 0 and "new store only" in again.output
    with pytest.raises(StoreError):
        Engine.open(tmp_path / "missing", read_only=True)
