"""certrag serve, live: the real CLI in a subprocess, the real small model (SmolLM2-135M), a real store, and the
clients its users have (the official `openai` package, plain HTTP). Oracles: the same models called in this process,
and the protocols' own rules (OpenAI's shapes, SSE framing, Prometheus' text format)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers import free_port

pytestmark = pytest.mark.slow  # live servers in subprocesses, Ray Serve

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"


def _start(store, *extra, key=KEY):
    port = free_port()
    args = [sys.executable, "-c", "from certrag.cli import main; main()", "serve", str(store), "--model", MODEL,
            "--port", str(port), *extra]
    env = dict(os.environ, CERTRAG_API_KEY=key) if key else {k: v for k, v in os.environ.items()
                                                             if k != "CERTRAG_API_KEY"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + proc.stdout.read())
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from certrag.config import EngineConfig, IndexConfig, RetrievalConfig
    from certrag.data.corpora import wiki_leads
    from certrag.engine import Engine

    path = tmp_path_factory.mktemp("serve") / "store"
    docs = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:30]]
    Engine.build(docs, path, EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8),
                                          index=IndexConfig(shards=2)), progress=False).close()
    return path


@pytest.fixture(scope="module", params=["local", "ray"])
def server(store, request):
    """The same suite runs against the single-process server and the Ray Serve one (Ingress, Encoders and
    Generator deployments on a local Ray cluster, the store's two shards as Ray actors). The local server runs two
    cross-encoder instances, so that its rankings are checked against the engine's with pairs cut across them."""
    extra = ["--rerank-instances", "2", "--read-timeout", "3"]
    if request.param == "ray":
        pytest.importorskip("ray")
        extra = ["--ray", "--shard-actors"]
    proc, url = _start(store, "--queue-depth", "3", "--encoder-depth", "2", "--max-wait-ms", "5", *extra)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(url, path, payload, key=KEY, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {}),
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _ready(url):
    with urllib.request.urlopen(url + "/ready", timeout=10) as r:
        return json.loads(r.read())


MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_chat_with_the_openai_client_streaming_and_not(client, smollm):
    local = smollm.generate(MESSAGES, max_new_tokens=24)
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    assert done.choices[0].message.content == local.text
    assert done.usage.completion_tokens == local.output_tokens
    assert done.choices[0].finish_reason == ("length" if local.finish_reason == "length" else "stop")
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=24,
                                                stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in pieces if p]) > 3  # token by token, not one piece at the end
    assert "".join(pieces).strip() == local.text
    assert finish in ("stop", "length")


def test_stop_max_completion_tokens_and_unsupported_options(client, smollm):
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = smollm.generate(msgs, max_new_tokens=40).text
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, stop=["7"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index("7")].strip()
    short = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=msgs, n=2)
    assert info.value.body["param"] == "n" or "n" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True)  # never silently ignored


def test_models_and_embeddings(client, server):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids and "sentence-transformers/all-MiniLM-L6-v2" in ids
    from certrag.embed import Embedder

    texts = ["the cat sat on the mat", "quantum chromodynamics"]
    got = client.embeddings.create(model="x", input=texts)
    want = Embedder.default().embed(texts)
    vec = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert vec.shape == want.shape and np.min(np.sum(vec * want, axis=1)) > 0.999
    import base64

    b64 = client.embeddings.create(model="x", input=texts[0], encoding_format="base64")
    assert np.allclose(np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4"), vec[0])
    assert got.usage.prompt_tokens == int(Embedder.default().count_tokens(texts).sum())


def test_chat_with_the_rag_model_answers_from_the_store_with_its_evidence(client, store, smollm, request):
    """The OpenAI client against the RAG model: the answer the engine gives in this process, its evidence in the
    `certrag` field; streaming ends with the evidence and, when asked for, OpenAI's usage chunk; an unknown model
    is 404; earlier turns reach the prompt."""
    if request.node.callspec.params.get("server") == "ray":  # (a suite-time budget: 26 s on 2 cores)
        pytest.skip("the same chat handler as on the local server; the RAG answer over Ray Serve's deployments is "
                    "test_answer_streams_retrieval_tokens_then_the_answer[ray]'s, the OpenAI client there "
                    "test_chat_with_the_openai_client_streaming_and_not[ray]'s")
    from certrag.engine import Engine

    question = "Who was Albert Einstein?"
    with Engine.open(store, read_only=True) as engine:
        want = engine.answer(question, llm=smollm, max_new_tokens=24)
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "certrag" and "certrag:chain_of_note" in ids and MODEL in ids
    done = client.chat.completions.create(model="certrag", messages=[{"role": "user", "content": question}],
                                          max_tokens=24)
    assert done.choices[0].message.content == want.text and done.model == "certrag"
    evidence = done.model_extra["certrag"]
    assert evidence["cited_chunk_ids"] == list(want.cited_chunk_ids)
    assert [c["chunk_id"] for c in evidence["retrieval"]["candidates"]] == [int(c) for c in want.retrieval.chunk_ids]
    assert done.usage.prompt_tokens == want.input_tokens and done.usage.completion_tokens == want.output_tokens
    chunks = list(client.chat.completions.create(model="certrag", messages=[{"role": "user", "content": question}],
                                                 max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.output_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.text
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-2].model_extra["certrag"]["cited_chunk_ids"] == list(want.cited_chunk_ids)
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)  # no usage chunk unless asked for
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert info.value.body["code"] == "model_not_found" and "certrag" in info.value.body["message"]
    turns = [{"role": "user", "content": "I am reading about physicists."},
             {"role": "assistant", "content": "Which one?"}, {"role": "user", "content": question}]
    followed = client.chat.completions.create(model="certrag", messages=turns, max_tokens=24)
    assert followed.usage.prompt_tokens > want.input_tokens  # the conversation reached the prompt
    assert followed.model_extra["certrag"]["retrieval"]["question"] == question  # retrieval reads the question


def test_rerank_and_retrieve_match_the_engine(server, store):
    from certrag.engine import Engine

    with Engine.open(store, read_only=True) as engine:
        want = engine.retrieve("What is Albert Einstein known for?")
        docs = list(want.texts[:5])
        fused = engine.reranker.score(want.question, docs, want.dense_scores[:5])
    status, _, body = _post(server, "/v1/retrieve", {"question": "What is Albert Einstein known for?"})
    assert status == 200
    got = json.loads(body)
    assert [c["chunk_id"] for c in got["candidates"]] == want.chunk_ids.tolist()
    status, _, body = _post(server, "/v1/rerank", {"query": want.question, "documents": docs, "top_n": 3,
                                                   "return_documents": True})
    assert status == 200
    results = json.loads(body)["results"]
    assert [r["index"] for r in results] == np.argsort(-fused)[:3].tolist()
    assert results[0]["document"]["text"] == docs[results[0]["index"]]
    long_question = "what is " + "the meaning of it all " * 80  # ~400 tokens: truncated, never a 500
    status, _, _ = _post(server, "/v1/retrieve", {"question": long_question})
    assert status == 200


def test_answer_streams_retrieval_tokens_then_the_answer(server):
    status, headers, body = _post(server, "/v1/answer", {"question": "Who was Albert Einstein?", "stream": True,
                                                         "max_new_tokens": 24})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = []
    for block in body.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    kinds = [k for k, _ in events]
    assert kinds[0] == "retrieval" and kinds[-1] == "answer" and "token" in kinds
    final = events[-1][1]
    from certrag.strategies.base import first_line

    # the tokens are the model's text as it is decoded; the answer is what the plain strategy reads from it, its
    # first line (a reader given more passages goes on after it: "Albert Einstein\n\nThe answer is: ...")
    assert first_line("".join(d for k, d in events if k == "token")) == final["answer"] and final["answer"]
    plain = json.loads(_post(server, "/v1/answer", {"question": "Who was Albert Einstein?",
                                                    "max_new_tokens": 24})[2])
    assert plain["answer"] == final["answer"]


def test_bad_input_gets_a_clear_4xx_never_a_5xx(server):
    chat = "/v1/chat/completions"
    cases = [
        (chat, {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
        (chat, {"messages": MESSAGES, "temperature": float("nan")}, 400),
        (chat, {"messages": MESSAGES, "seed": 2**70}, 400),
        (chat, {"messages": MESSAGES, "seed": False}, 400),
        (chat, {"messages": MESSAGES, "max_tokens": "5"}, 400),
        (chat, {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 10}, 400),
        ("/v1/answer", {"question": "q", "confidence": 0}, 422),
        ("/v1/answer", {"question": "\ud800"}, 422),
        ("/v1/retrieve", {"question": "q", "candidates": True}, 422),
    ]
    for path, payload, want in cases:
        status, _, body = _post(server, path, payload)
        assert status == want, (path, payload, status, body[:200])
        if path == chat:
            err = json.loads(body)["error"]
            assert err["message"] and err["type"] == "invalid_request_error"
    status, _, body = _post(server, chat, {"messages": [{"role": "user", "content": "word " * 9000}],
                                           "max_tokens": 10})
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    status, _, body = _post(server, chat, None, raw=b'{"messages": [')  # said "1: JSON decode error", param "1"
    err = json.loads(body)["error"]
    assert status == 400 and "not valid JSON" in err["message"] and err["param"] is None


def test_a_question_whose_options_overrun_the_context_is_refused_before_it_queues(server):
    """A multiple-choice question with 100 options of 480 characters overran the model's 8,192 positions and the
    prefill ran on; it must get 400 naming the limit before it queues, on both servers."""
    options = [f"option {i}: " + "a long description of a colour " * 15 for i in range(100)]
    status, _, body = _post(server, "/v1/answer", {"question": "Which is blue?", "options": options})
    assert status == 400, body[:300]
    assert b"context of 8192 tokens" in body
    assert _ready(server)["queue"] == 0


def test_a_slow_client_is_dropped_after_the_read_timeout(server, request):
    """Partial headers or a body that stops arriving held a connection open for 130 s; the local server (its read
    timeout 3 s here) closes one, and answers 408 to the other."""
    if request.node.callspec.params.get("server") == "ray":
        pytest.skip("Ray Serve's HTTP proxy has its own connection handling")
    host, port = server.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        started = time.time()
        assert s.recv(1024) == b""  # closed by the server, without an answer
        assert 2 <= time.time() - started < 10
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"question\"")
        started = time.time()
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and 2 <= time.time() - started < 10
    assert _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})[0] == 200


def test_body_limit_counts_chunked_bytes(server):
    host, port = server.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    piece = b"x" * 65536

    def body():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(48):  # 3 MB, with no Content-Length
            yield piece
        yield b'"}]}'

    conn.request("POST", "/v1/chat/completions", body=body(), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                          "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()


def test_api_key_on_every_route_but_health_and_ready(server):
    assert _post(server, "/v1/retrieve", {"question": "q"}, key=None)[0] == 401
    assert _post(server, "/v1/retrieve", {"question": "q"}, key="wrong")[0] == 401
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server + "/metrics", timeout=10)
    assert info.value.code == 401
    with urllib.request.urlopen(server + "/health", timeout=10) as r:
        assert r.status == 200


def _at_once(url, path, payloads) -> list[tuple[int, str | None]]:
    """(status, Retry-After) of each payload, all posted at the same time."""
    statuses, lock = [], threading.Lock()

    def one(payload):
        status, headers, _ = _post(url, path, payload)
        with lock:
            statuses.append((status, headers.get("Retry-After")))

    threads = [threading.Thread(target=one, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_overload_gets_429_with_retry_after_and_no_5xx(server):
    statuses = _at_once(server, "/v1/chat/completions", [{"messages": MESSAGES, "max_tokens": 48}] * 8)
    codes = [s for s, _ in statuses]
    assert all(s in (200, 429) for s in codes), codes
    assert codes.count(429) >= 1 and codes.count(200) >= 3  # queue depth 3
    assert all(ra for s, ra in statuses if s == 429)


def test_concurrent_chats_share_decode_steps(server, request):
    """No model lock: generations admitted together are decoded in the same steps of the engine (the server used to
    run them one at a time). /ready reports how many sequences the engine is decoding now."""
    if "ray" in request.node.callspec.id:
        pytest.skip("on Ray Serve the model runs in the Generator deployment's process")
    payloads = [{"messages": [{"role": "user", "content": f"Count from {i} to {i + 60}."}], "max_tokens": 60}
                for i in range(3)]
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(_ready(server).get("decoding", 0))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        statuses = _at_once(server, "/v1/chat/completions", payloads)
    finally:
        done.set()
        watcher.join()
    assert [s for s, _ in statuses] == [200, 200, 200]
    assert max(seen) >= 2, seen


def test_retrieval_overload_gets_429_too(server):
    statuses = _at_once(server, "/v1/retrieve", [{"question": f"question number {i} about art"} for i in range(12)])
    codes = [s for s, _ in statuses]
    assert all(s in (200, 429) for s in codes), codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2  # encoder depth 2
    assert all(ra for s, ra in statuses if s == 429)
    assert _ready(server)["encoder_requests"] == 0


def _queue_empties(url, within=10.0) -> bool:
    end = time.time() + within
    while time.time() < end:
        if _ready(url)["queue"] == 0:
            return True
        time.sleep(0.1)
    return False


def test_a_client_that_leaves_or_a_deadline_stops_the_generation(server):
    host, port = server.split("//")[1].split(":")
    # a long streamed generation (~2000 tokens: a minute or more of decoding), abandoned after a few chunks
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions",
                 body=json.dumps({"messages": [{"role": "user", "content": "Write a very long story."}],
                                  "max_tokens": 2000, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read1(256)
    assert _ready(server)["queue"] == 1
    conn.close()
    assert _queue_empties(server), "the abandoned generation kept running"
    # a deadline: 504, and the work stops too
    status, _, body = _post(server, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Write a very long story."}],
                             "max_tokens": 2000, "timeout": 1.0})
    assert status == 504 and json.loads(body)["error"]["code"] == "deadline_exceeded"
    assert _queue_empties(server)
    # the model itself stopped (on Ray Serve it runs in another process): a short answer does not wait behind the
    # two abandoned 2000-token generations
    started = time.time()
    status, _, _ = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert status == 200 and time.time() - started < 20


def test_metrics_parse_as_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("certrag_request_seconds", "certrag_stage_seconds", "certrag_batch_items",
                 "certrag_generation_queue", "certrag_tokens", "certrag_rejected"):
        assert name in families, sorted(families)
    routes = {s.labels.get("route") for s in families["certrag_request_seconds"].samples}
    assert "/v1/chat/completions" in routes and "/v1/retrieve" in routes
    rejected = {s.labels.get("reason") for s in families["certrag_rejected"].samples if s.value > 0}
    assert {"unauthorized", "too_large", "queue_full"} <= rejected


def test_sigterm_drains_in_flight_requests_then_exits(store):
    proc, url = _start(store, key=None)
    result = {}

    def one():
        result["reply"] = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 48}, key=None)

    t = threading.Thread(target=one)
    t.start()
    end = time.time() + 30
    while _ready(url)["queue"] == 0 and time.time() < end:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert result["reply"][0] == 200 and json.loads(result["reply"][2])["choices"][0]["message"]["content"]
    # uvicorn re-raises the signal once drained, so a process manager sees the exit that it asked for
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_schemathesis_finds_no_server_errors_or_schema_violations(store, tmp_path):
    """A short property-based run over /openapi.json: every response has a documented status and shape and no
    request makes a 5xx. Generation is capped by a short server deadline (504 is documented)."""
    import shutil

    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("schemathesis is not installed")
    from prometheus_client.parser import text_string_to_metric_families

    proc, url = _start(store, "--timeout", "3", "--queue-depth", "64", key=None)
    try:
        # a 504 (the deadline, documented) is a 5xx to schemathesis: the server's own count of 5xx other than 504
        # is checked below instead
        run = subprocess.run([exe, "run", url + "/openapi.json", "--max-examples", "6", "--checks", "all",
                              "--exclude-checks", "not_a_server_error,positive_data_acceptance,"
                              "missing_required_header,unsupported_method,ignored_auth", "--phases",
                              "examples,fuzzing", "--request-timeout", "30", "--generation-deterministic",
                              "--no-color"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    finally:
        _stop(proc)
    assert run.returncode == 0, run.stdout[-4000:]
    counts = [s for s in families["certrag_request_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in counts) > 20  # schemathesis did send its requests
    errors = {s.labels["status"]: s.value for s in counts if s.labels["status"].startswith("5")
              and s.labels["status"] != "504" and s.value > 0}
    assert not errors, errors


def _judge_installed() -> bool:
    """Whether the default reranker ships an answer-presence rule and its reader's packages are installed."""
    from certrag.llm.models import BUNDLED_MODELS
    from certrag.rerank import PACKAGE_RERANKER

    rules = list(PACKAGE_RERANKER.glob("presence-*.json"))
    if not rules:
        return False
    judge = json.loads(rules[0].read_text())["judge"]
    return judge in BUNDLED_MODELS and BUNDLED_MODELS[judge].installed


def test_the_web_page_streams_an_answer_with_its_evidence_in_a_real_browser(server, store, tmp_path, request):
    """Headless Chromium (the system's, through Selenium and chromedriver) on `/`, in the page's three states: a
    supported, certified answer; a question the store cannot answer (the trust line warns of weak retrieval); an
    answer cut at the token limit (the trust line says so). Each is checked on the DOM against the same question
    asked over HTTP. Screenshots go to the test's folder, and to benchmarks/results/serve_page_<state>.png (kept in
    the repository) with CERTRAG_KEEP_SCREENSHOT=1."""
    if request.node.callspec.params.get("server") == "ray":  # (a suite-time budget: 26 s on 2 cores)
        pytest.skip("the page is the same app's static files on both servers; its streams over Ray Serve's proxy "
                    "are test_answer_streams_retrieval_tokens_then_the_answer[ray]'s")
    import shutil
    from pathlib import Path

    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,1100"):
        options.add_argument(flag)
    keep = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    shown = {}
    try:
        browser.get(server + "/")
        wait = WebDriverWait(browser, 120)
        wait.until(lambda b: "ready" in b.find_element(By.ID, "status").text)
        # this model has no factuality classifier: the page offers no confidence box
        assert not browser.find_element(By.ID, "confidence-box").is_displayed()
        browser.find_element(By.ID, "key").send_keys(KEY)
        for state, question, certify, max_tokens in (
                # the store holds the Aeneid's article; room for a whole sentence: SmolLM2's q8 answer differs
                # between CPUs (torch's kernels round differently on AVX2 and AVX-512) and ran past 32 tokens on one
                ("trusted", "Who wrote the Aeneid?", True, 128),
                ("untrusted", "What is the boiling point of mercury in degrees Celsius?", False, None),
                ("cut", "Who wrote the Aeneid?", False, 2)):
            box = browser.find_element(By.ID, "question")
            box.clear()
            box.send_keys(question)
            tick = browser.find_element(By.ID, "certify")
            if tick.is_selected() != certify:
                tick.click()
            limit = browser.find_element(By.ID, "max-tokens")
            limit.clear()
            if max_tokens:
                limit.send_keys(str(max_tokens))
            browser.find_element(By.ID, "go").click()
            seen = set()

            def finished(b):
                seen.add(b.find_element(By.ID, "answer").text)  # the answer as it grows
                return b.find_element(By.ID, "trust").is_displayed() and b.find_element(By.ID, "answer-meta").text

            try:
                wait.until(finished)
            except Exception:  # say what the page shows, not only that it timed out
                raise AssertionError(f"{state}: the answer never finished; the page shows "
                                     f"{browser.find_element(By.ID, 'answer').text!r}") from None
            trust = browser.find_element(By.ID, "trust")
            shown[state] = {
                "answer": browser.find_element(By.ID, "answer").text, "seen": seen,
                "trust": trust.text, "trust_class": trust.get_attribute("class"),
                "meta": browser.find_element(By.ID, "answer-meta").text,
                "rows": [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#candidates tbody tr")],
                "cut": browser.find_element(By.ID, "cut").text, "stages": browser.find_element(By.ID, "stages").text,
                "trusted_docs": len(browser.find_elements(By.CSS_SELECTOR, "#candidates td.trusted"))}
            browser.save_screenshot(str(tmp_path / f"serve_page_{state}.png"))
            if os.environ.get("CERTRAG_KEEP_SCREENSHOT") == "1":
                keep.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(keep / f"serve_page_{state}.png"))
            assert (tmp_path / f"serve_page_{state}.png").stat().st_size > 10_000
        # judged support is offered where the store's reranker ships a presence rule and its reader is installed
        # (the 1.5B reader: not installed by `make test`, so CI sees the box hidden)
        offered = _judge_installed()
        assert browser.find_element(By.ID, "judge-box").is_displayed() is offered is _ready(server)["judge_support"]
        if offered:
            box = browser.find_element(By.ID, "question")
            box.clear()
            box.send_keys("What is the boiling point of mercury in degrees Celsius?")
            browser.find_element(By.ID, "max-tokens").clear()
            browser.find_element(By.ID, "judge").click()
            browser.find_element(By.ID, "go").click()
            wait.until(lambda b: b.find_element(By.ID, "trust").is_displayed()
                       and b.find_element(By.ID, "answer-meta").text)
            trust = browser.find_element(By.ID, "trust")
            assert trust.get_attribute("class") == "warn" and "may not hold the answer" in trust.text
            assert "log-odds" in trust.text and "qwen2.5-coder-1.5b-instruct" in trust.text
            browser.save_screenshot(str(tmp_path / "serve_page_judged.png"))
            if os.environ.get("CERTRAG_KEEP_SCREENSHOT") == "1":
                browser.save_screenshot(str(keep / "serve_page_judged.png"))
        # a chunk opens to its whole text with its document and position
        first = browser.find_element(By.CSS_SELECTOR, "#candidates tbody tr details")
        first.find_element(By.TAG_NAME, "summary").click()
        assert "document " in first.text and " · chunk " in first.text and "candidate 1" in first.text
        assert browser.execute_script("return plain(arguments[0])", "## Warranty\n**Three** years, see [terms](x).") \
            == "Warranty\nThree years, see terms."
        legend = browser.find_element(By.ID, "legend").text
        assert all(w in legend for w in ("selected", "cited", "the cut", "trusted"))
    finally:
        browser.quit()
    ask = {"question": "Who wrote the Aeneid?"}
    want = json.loads(_post(server, "/v1/answer", {**ask, "certify": True, "max_new_tokens": 128})[2])
    assert want["finish_reason"] == "stop", want["answer"]  # else the page rightly warns that the answer was cut
    retrieved = json.loads(_post(server, "/v1/retrieve", ask)[2])
    page = shown["trusted"]
    assert page["answer"].strip() == want["answer"]
    assert len(page["rows"]) == len(retrieved["candidates"]) == 8
    assert [r.split()[1] for r in page["rows"]] == [c["doc_id"].split()[0] for c in retrieved["candidates"]]
    assert page["cut"].startswith(f"{retrieved['selected']} of 8 candidates selected")
    assert "embed" in page["stages"] and "rerank" in page["stages"] and "generate" in page["stages"]
    assert len(page["seen"]) >= 2  # it grew: streamed, not shown at once
    assert want["support"]["supported"] and want["certification"]["applied"]
    assert page["trust_class"] == "ok" and page["trust"].startswith("Supported") and "Certified" in page["trust"]
    assert page["trusted_docs"] == sum(want["certification"]["trusted"]) > 0
    off = json.loads(_post(server, "/v1/answer", {"question": "What is the boiling point of mercury in degrees "
                                                              "Celsius?"})[2])
    assert not off["support"]["supported"]
    page = shown["untrusted"]
    assert page["trust_class"] == "warn" and "Weak retrieval" in page["trust"] and "NQ-open" in page["trust"]
    page = shown["cut"]
    assert page["trust_class"] == "warn" and "cut at the token limit" in page["trust"]
    assert "finish_reason: length" in page["meta"]
