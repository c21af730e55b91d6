"""The OpenAI-compatible client against real servers on loopback: certrag's own (uvicorn + FastAPI + SmolLM2), and
small standard-library servers that fail or hang."""

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from certrag.llm.openai_client import LLMHTTPError, OpenAIChatClient  # noqa: E402


@pytest.fixture(scope="module")
def served(smollm):
    import uvicorn

    from certrag.serve.app import create_app

    llm = smollm
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(llm, max_body_bytes=4096), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield llm, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_client_against_the_real_server(served):
    llm, url = served
    client = OpenAIChatClient(url, "smollm2-135m-instruct", timeout=60)
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    g = client.generate(messages, max_new_tokens=10)
    local = llm.generate(messages, max_new_tokens=10)
    assert g.text == local.text
    assert (g.input_tokens, g.output_tokens) == (local.input_tokens, local.output_tokens)
    schema = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())
    assert "/v1/chat/completions" in schema["paths"] and "/v1/answer" in schema["paths"]


def test_server_refuses_bad_and_oversized_requests(served):
    _, url = served
    client = OpenAIChatClient(url, "m", timeout=30, retries=0)
    with pytest.raises(LLMHTTPError) as info:
        client._post("/v1/chat/completions", {"messages": [], "max_tokens": 5})
    assert info.value.status == 400  # OpenAI's status and shape for an invalid request
    with pytest.raises(LLMHTTPError) as info:
        client._post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10000}]})
    assert info.value.status == 413
    with pytest.raises(LLMHTTPError) as info:
        client._post("/v1/answer", {"question": "q"})
    assert info.value.status == 404


class _Flaky(BaseHTTPRequestHandler):
    failures = 2
    hits = 0
    delay = 0.0

    def do_POST(self):  # noqa: N802
        type(self).hits += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.delay:
            time.sleep(self.delay)
        if type(self).hits <= self.failures:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        body = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_retries_with_backoff_then_succeeds_or_reports_the_error():
    handler = type("H", (_Flaky,), {"failures": 2, "hits": 0})
    server, url = _serve(handler)
    try:
        g = OpenAIChatClient(url, "m", retries=3, backoff=0.01).generate([{"role": "user", "content": "x"}])
        assert g.text == "ok" and g.input_tokens == 3 and handler.hits == 3
        handler.hits = 0
        with pytest.raises(LLMHTTPError, match="503.*after 2 attempts") as info:
            OpenAIChatClient(url, "m", retries=1, backoff=0.01).generate([{"role": "user", "content": "x"}])
        assert info.value.status == 503
    finally:
        server.shutdown()


def test_a_hanging_server_times_out():
    handler = type("H", (_Flaky,), {"failures": 0, "hits": 0, "delay": 3.0})
    server, url = _serve(handler)
    try:
        started = time.time()
        with pytest.raises(LLMHTTPError, match="timed out"):
            OpenAIChatClient(url, "m", timeout=0.3, retries=1, backoff=0.01).generate([{"role": "user", "content": "x"}])
        assert time.time() - started < 2.5
    finally:
        server.shutdown()


def test_client_bad_arguments():
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChatClient("localhost:8000", "m")
    with pytest.raises(ValueError, match="timeout"):
        OpenAIChatClient("http://x", "m", timeout=0)
    with pytest.raises(LLMHTTPError):
        OpenAIChatClient(f"http://127.0.0.1:{free_port()}", "m", retries=0).generate([{"role": "user",
                                                                                        "content": "x"}])
