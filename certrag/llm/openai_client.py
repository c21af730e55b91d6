"""A client for OpenAI-compatible chat-completion servers (certrag serve, vLLM, llama.cpp's server, hosted APIs).

Standard library only (urllib). Timeouts per request; retries with exponential backoff on connection errors,
timeouts, 429 and 5xx; a clear LLMHTTPError on other 4xx. Token counts come from the server's ``usage``.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

from certrag.llm.local import Generation


class LLMHTTPError(RuntimeError):
    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


class OpenAIChatClient:
    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://; got {base_url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive; got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0; got {retries}")
        self.base_url = base_url.rstrip("/")
        self.name = model
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def _post(self, path: str, payload: dict) -> dict:
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read().decode())
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")[:300]
                if exc.code == 429 or exc.code >= 500:
                    last = LLMHTTPError(exc.code, f"{url} answered {exc.code}: {body}")
                    continue
                raise LLMHTTPError(exc.code, f"{url} answered {exc.code}: {body}") from None
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                last = LLMHTTPError(None, f"{url}: {'timed out' if 'timed out' in str(reason) else reason}")
            except json.JSONDecodeError:
                raise LLMHTTPError(None, f"{url} did not answer with JSON") from None
        raise LLMHTTPError(getattr(last, "status", None),
                           f"{last} (after {self.retries + 1} attempts)") from None

    def generate(self, messages: list[dict], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int | None = None, record_lookback: bool = False, stop: list[str] | tuple[str, ...] = ()
                 ) -> Generation:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if record_lookback:
            raise ValueError("record_lookback needs a local model (certrag LocalLLM): it reads the model's attention, "
                             "which an OpenAI-compatible server does not expose")
        payload = {"model": self.name, "messages": messages, "max_tokens": max_new_tokens,
                   "temperature": temperature}
        if seed is not None:
            payload["seed"] = seed
        if stop:
            payload["stop"] = list(stop)
        started = time.perf_counter()
        reply = self._post("/v1/chat/completions", payload)
        try:
            choice = reply["choices"][0]
            usage = reply.get("usage") or {}
            return Generation(text=(choice["message"]["content"] or "").strip(),
                              input_tokens=int(usage.get("prompt_tokens", 0)),
                              output_tokens=int(usage.get("completion_tokens", 0)),
                              seconds=time.perf_counter() - started,
                              finish_reason=choice.get("finish_reason") or "stop")
        except (KeyError, IndexError, TypeError) as exc:
            raise LLMHTTPError(None, f"unexpected reply shape from {self.base_url}: {exc}") from None
