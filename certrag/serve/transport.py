"""The HTTP connection's own limit: a client has read_timeout_s to send a request's head.

uvicorn drops idle keep-alive connections but holds one that sends part of a request line or headers for as long as
the client likes (the review held 130 s with partial headers). The protocol below closes a connection whose request
head has not arrived within read_timeout_s of its start or of its previous response; the body's own timeout is the
ASGI guard's (certrag.serve.app), since the app reads the body.
"""

from __future__ import annotations


def protocol_with_read_timeout(read_timeout_s: float):
    """uvicorn's HTTP protocol class (httptools where installed, as uvicorn picks, else h11) with the head timeout."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # no httptools: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class ReadTimeoutProtocol(Base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()  # no request in progress: its head never came

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    ReadTimeoutProtocol.__name__ = f"ReadTimeout{Base.__name__}"
    return ReadTimeoutProtocol
