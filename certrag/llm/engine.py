"""The decode engine: one scheduler thread owns the model and batches every concurrent generation.

Shaped as vLLM's and TGI's: a request is a sequence with its own options (max tokens, temperature and seed, stop
strings, a streaming callback, cancellation and a deadline, lookback recording over its spans, or only the next
token's probabilities). Each step of the scheduler
  1. admits waiting sequences while fewer than `max_batch` run (each gets its own KV cache, sized to its prompt
     plus its max tokens);
  2. retires sequences that were cancelled or passed their deadline (their cache is freed at once);
  3. prefills one chunk (`prefill_chunk` tokens) of the oldest sequence still reading its prompt, so a long prompt
     does not stall the decodes running beside it; its last chunk gives its first token;
  4. decodes one token for every sequence past its prompt, in one batched forward pass;
  5. retires what finished (end of sequence, a stop string, max tokens).

Chunk boundaries depend only on the sequence, and the decoder's products are batch invariant (certrag.llm.decoder),
so greedy tokens are the same whether a sequence runs alone or among others. Callers block on a future (or stream);
no lock is held across a request.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from certrag.llm.decoder import Decoder, KVCache, Spans

log = logging.getLogger(__name__)

_open_engines: "weakref.WeakSet[DecodeEngine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    """A scheduler thread still inside torch when the interpreter finalises aborts the process ("terminate called
    without an active exception"): every started engine is stopped and joined first."""
    for engine in list(_open_engines):
        engine.close()


class PromptTooLong(ValueError):
    """A prompt that, with the tokens asked for, does not fit the model's context: refused before any work."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {limit} tokens")
        self.prompt_tokens, self.max_new_tokens, self.limit = prompt_tokens, max_new_tokens, limit


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int = 128  # 0 with probe: only the next token's probabilities
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], None] | None = None  # called from the scheduler thread with each new piece of text
    cancelled: Callable[[], bool] | None = None  # polled before every step; true stops the sequence there
    deadline: float | None = None  # time.monotonic() after which the sequence is cancelled
    chunk_spans: tuple[tuple[int, int], ...] | None = None  # record lookback over these prompt spans
    probe: tuple[int, ...] | None = None  # token ids whose next-token probabilities are returned (no decoding)

    def validate(self, context_length: int, vocab: int) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if any(not 0 <= t < vocab for t in self.prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if self.probe is None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {self.max_new_tokens}")
        if self.probe is not None and any(not 0 <= t < vocab for t in self.probe):
            raise ValueError(f"probe token ids must lie in [0, {vocab})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if len(self.prompt) + self.max_new_tokens > context_length:
            raise PromptTooLong(len(self.prompt), self.max_new_tokens, context_length)
        for a, b in self.chunk_spans or ():
            if not 0 <= a <= b <= len(self.prompt):
                raise ValueError(f"chunk span ({a}, {b}) must lie inside the prompt (0..{len(self.prompt)})")


@dataclass
class Result:
    token_ids: list[int]
    token_logprobs: list[float]
    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    input_tokens: int
    seconds: float
    masses: list[np.ndarray] | None = None  # per decode step (layers, heads, 2 + chunks), when recording
    chunk_spans: list[tuple[int, int]] | None = None  # the recorded spans
    probs: np.ndarray | None = None  # the probe's next-token probabilities


class _TextWatch:
    """Streams a sequence's text deltas and finds its stop strings as tokens arrive."""

    def __init__(self, tokenizer, stop: tuple[str, ...], on_text) -> None:
        self.tokenizer, self.stop, self.on_text = tokenizer, stop, on_text
        self.sent = 0  # characters already handed to on_text
        self.stopped_at: int | None = None
        self.hold = max((len(x) for x in stop), default=1) - 1  # a stop string may be arriving: keep its length

    def push(self, tokens: list[int]) -> bool:
        """After a new token: streams what is ready; True when a stop string has appeared."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        done = False
        if self.stop:
            hits = [i for i in (text.find(x, max(0, self.sent - self.hold)) for x in self.stop) if i >= 0]
            if hits:
                self.stopped_at = min(hits)
                text, done = text[:self.stopped_at], True
        if self.on_text is not None:
            # a trailing U+FFFD is half of a multi-byte character: wait for the rest
            ready = len(text) if done else len(text.rstrip("\ufffd")) - (self.hold if self.stop else 0)
            if ready > self.sent:
                self.on_text(text[self.sent:ready])
                self.sent = ready
        return done

    def finish(self, text: str) -> str:
        if self.stopped_at is not None:
            text = text[:self.stopped_at]
        if self.on_text is not None and len(text) > self.sent:
            self.on_text(text[self.sent:])
            self.sent = len(text)
        return text


class _Sequence:
    def __init__(self, request: Request, future: Future, tokenizer, submitted: float) -> None:
        self.r = request
        self.future = future
        self.submitted = submitted
        self.cache: KVCache | None = None
        self.prefilled = 0
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.spans = Spans(len(request.prompt), list(request.chunk_spans)) \
            if request.chunk_spans is not None else None
        self.watch = _TextWatch(tokenizer, request.stop, request.on_text) \
            if (request.stop or request.on_text) else None
        self.generator = None
        if request.temperature > 0:
            import torch

            self.generator = torch.Generator().manual_seed(0 if request.seed is None else request.seed)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.r.prompt)


class DecodeEngine:
    """Continuous batching over a Decoder. submit() returns a Future of a Result; generate() waits for it."""

    def __init__(self, decoder: Decoder, tokenizer, *, max_batch: int = 16, prefill_chunk: int = 64,
                 max_waiting: int = 1024) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1; got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1; got {prefill_chunk}")
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.config = decoder.c
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self._eos = set(self.config.eos_ids)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # decode steps run (for tests and metrics)
        self.max_rows = 0  # the most sequences one decode step has carried
        self.decoded = 0  # tokens made by decode steps (first tokens come from prefill)
        self.decode_seconds = 0.0  # time spent in decode steps

    # -- the callers' side --------------------------------------------------------------------------------------

    def submit(self, request: Request) -> Future:
        request.validate(self.config.context_length, self.config.vocab)
        future: Future = Future()
        seq = _Sequence(request, future, self.tokenizer, time.perf_counter())
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode engine is closed")
            if len(self._waiting) >= self.max_waiting:
                raise RuntimeError(f"the decode engine's queue is full ({self.max_waiting} waiting)")
            self._waiting.append(seq)
            if self._thread is None:
                self._start()
            self._wake.notify()
        return future

    def generate(self, request: Request) -> Result:
        return self.submit(request).result()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences now."""
        with self._wake:
            return len(self._running), len(self._waiting)

    # -- the scheduler thread -----------------------------------------------------------------------------------

    def _start(self) -> None:
        import torch

        ready = threading.Event()
        before = torch.get_num_threads()

        def run():
            torch.get_num_threads()  # this thread's own setting is made now, from the process default
            torch.set_num_threads(1)  # small ops on one thread (spin-waiting OpenMP threads cost 3-7x, MODELS.md)
            ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="certrag-decode", daemon=True)
        self._thread.start()
        _open_engines.add(self)
        ready.wait()
        torch.set_num_threads(before)  # the process default again, as it was

    def _loop(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closed and not self._waiting and not self._running:
                        self._wake.wait()
                    if self._closed:
                        for seq in list(self._waiting) + self._running:
                            if not seq.future.done():
                                seq.future.set_exception(RuntimeError("the decode engine was closed"))
                        self._waiting.clear()
                        self._running.clear()
                        return
                    while self._waiting and len(self._running) < self.max_batch:
                        self._running.append(self._waiting.popleft())
                running = list(self._running)
                try:
                    self._step(running)
                except BaseException as exc:  # noqa: BLE001 -- handed to every caller of the step
                    log.exception("decode step failed")
                    for seq in running:
                        self._retire(seq, error=exc)

    def _step(self, running: list[_Sequence]) -> None:
        now = time.monotonic()
        for seq in running:
            r = seq.r
            if seq.future.cancelled() or (r.cancelled is not None and r.cancelled()) or \
                    (r.deadline is not None and now > r.deadline):
                self._retire(seq, "cancelled")
        live = [s for s in running if not s.future.done()]
        pending = next((s for s in live if not s.decoding), None)
        if pending is not None:
            self._prefill_chunk(pending)
        rows = [s for s in live if s.decoding and s.tokens and not s.future.done() and s is not pending]
        if rows:
            started = time.perf_counter()
            logits = self.decoder.decode([s.cache for s in rows], [s.tokens[-1] for s in rows],
                                         [s.spans for s in rows])
            self.decode_seconds += time.perf_counter() - started
            self.decoded += len(rows)
            self.steps += 1
            self.max_rows = max(self.max_rows, len(rows))
            for i, seq in enumerate(rows):
                self._advance(seq, logits[i])

    def _prefill_chunk(self, seq: _Sequence) -> None:
        prompt = seq.r.prompt
        if seq.cache is None:
            seq.cache = KVCache.allocate(self.decoder.w, len(prompt) + max(seq.r.max_new_tokens, 0))
        end = min(len(prompt), seq.prefilled + self.prefill_chunk)
        hidden = self.decoder.prefill(seq.cache, list(prompt[seq.prefilled:end]))
        seq.prefilled = end
        if not seq.decoding:
            return
        logits = self.decoder.logits(hidden)[0]
        if seq.r.probe is not None:
            import torch

            p = torch.softmax(logits.double(), -1)[list(seq.r.probe)].numpy()
            self._retire(seq, "stop", probs=p)
            return
        self._advance(seq, logits)

    def _advance(self, seq: _Sequence, logits) -> None:
        """Chooses the sequence's next token from its logits (vocab,) and retires it when finished."""
        import torch

        r = seq.r
        if r.temperature > 0:
            scaled = logits / r.temperature
            token = int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=seq.generator))
        else:
            scaled = logits
            token = int(torch.argmax(logits))
        seq.logprobs.append(float(torch.log_softmax(scaled, -1)[token]))
        seq.tokens.append(token)
        if token in self._eos:
            self._retire(seq, "stop")
        elif seq.watch is not None and seq.watch.push(seq.tokens):
            self._retire(seq, "stop")
        elif len(seq.tokens) >= r.max_new_tokens:
            self._retire(seq, "length")

    def _retire(self, seq: _Sequence, finish: str = "stop", *, probs=None, error=None) -> None:
        with self._wake:
            if seq in self._running:
                self._running.remove(seq)
        seq.cache = None
        if seq.future.done():
            return
        if error is not None:
            seq.future.set_exception(error)
            return
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        if seq.watch is not None:
            text = seq.watch.finish(text)
        seq.future.set_result(Result(
            token_ids=seq.tokens, token_logprobs=seq.logprobs, text=text, finish_reason=finish,
            input_tokens=len(seq.r.prompt), seconds=time.perf_counter() - seq.submitted,
            masses=seq.spans.masses if seq.spans is not None else None,
            chunk_spans=seq.spans.chunks if seq.spans is not None else None, probs=probs))
