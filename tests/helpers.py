"""What several test files share (imported as `helpers`: tests/ is on sys.path through its conftest.py)."""

import socket

from certrag.config import EngineConfig, RetrievalConfig

# a store quick to build: sentence chunks, 8 candidates, no cross-encoder
FAST = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8, rerank=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
