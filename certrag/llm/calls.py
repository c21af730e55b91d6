"""One call's view of a shared model: the per-call options (a token callback, a cancellation check) travel with
the call in this wrapper, never as state on the model itself."""

from __future__ import annotations

from typing import Callable

from certrag.protocols import streams


class Cancelled(Exception):
    """The call was cancelled before the model started on it."""


class CallView:
    """llm as one call sees it: every generate() streams its text to on_text (a remote model's answer arrives as one
    piece) and a local model stops at the next token once cancelled() is true. Everything else is the model's."""

    def __init__(self, llm, *, on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> None:
        self._llm = llm
        self._on_text = on_text
        self._cancelled = cancelled

    def generate(self, messages, **kwargs):
        if self._cancelled is not None and self._cancelled():
            raise Cancelled()
        local = streams(self._llm)  # a LocalLLM (or a Ray Serve one) streams per token
        if local:
            if self._cancelled is not None:
                kwargs.setdefault("cancelled", self._cancelled)
            if self._on_text is not None:
                kwargs.setdefault("on_text", self._on_text)
        g = self._llm.generate(messages, **kwargs)
        if not local and self._on_text is not None and g.text:
            self._on_text(g.text)
        return g

    def __getattr__(self, name):
        return getattr(self._llm, name)
