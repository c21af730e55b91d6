"""The one bridge from a worker thread to a stream: fn(emit) runs in its own thread, and what it emits, then its
return value or its error, reach the consumer in order -- a plain loop (LocalLLM.stream) or an event loop (certrag
serve's server-sent events, Ray Serve's streaming Generator). A consumer that leaves early sets the cancel event,
which the work polls (a generation stops at its next token).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator

ITEM, DONE, ERROR, TIMEOUT = "item", "done", "error", "timeout"


class ThreadStream:
    """fn(emit) in a daemon thread, started by the first iteration; iterate once, with `for` or with events().

    for piece in stream: the emitted items; fn's return value is then stream.result, and its error is raised.
    async for kind, value in stream.events(timeout): (ITEM, x)..., then (DONE, result) or (ERROR, exc), or
    (TIMEOUT, None) when timeout seconds pass first. on_end() runs in the worker thread when fn has returned or
    raised (a server gives the request's place in its queue back there)."""

    def __init__(self, fn: Callable[[Callable[[Any], None]], Any], *, cancel: threading.Event | None = None,
                 on_end: Callable[[], None] | None = None, name: str = "certrag-stream") -> None:
        self.cancel = cancel if cancel is not None else threading.Event()
        self.result: Any = None
        self._fn, self._on_end, self._name = fn, on_end, name
        self._started = False
        self._ended = threading.Event()

    def _start(self, put: Callable[[tuple], None]) -> None:
        if self._started:
            raise RuntimeError("a ThreadStream is iterated once")
        self._started = True

        def work() -> None:
            try:
                self.result = self._fn(lambda item: put((ITEM, item)))
                put((DONE, self.result))
            except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, which raises or reports it
                put((ERROR, exc))
            finally:
                self._ended.set()
                if self._on_end is not None:
                    self._on_end()

        threading.Thread(target=work, daemon=True, name=self._name).start()

    def __iter__(self) -> Iterator[Any]:
        items: queue.SimpleQueue = queue.SimpleQueue()
        self._start(items.put)
        try:
            while True:
                kind, value = items.get()
                if kind == ITEM:
                    yield value
                elif kind == DONE:
                    return
                else:
                    raise value
        finally:
            self.cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until fn has returned or raised (True), or timeout seconds pass (False)."""
        return self._ended.wait(timeout)

    async def events(self, timeout: float | None = None) -> AsyncIterator[tuple[str, Any]]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._start(lambda event: loop.call_soon_threadsafe(items.put_nowait, event))
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    left = None if end is None else max(0.01, end - time.monotonic())
                    kind, value = await asyncio.wait_for(items.get(), timeout=left)
                except asyncio.TimeoutError:
                    yield TIMEOUT, None
                    return
                yield kind, value
                if kind != ITEM:
                    return
        finally:  # the consumer left (a response cancelled) or the stream ended
            self.cancel.set()
