"""What several test files share (imported as `helpers`: tests/ is on sys.path through its conftest.py)."""

import socket

from certrag.config import EngineConfig, RetrievalConfig

# a store quick to build: sentence chunks, 8 candidates, no cross-encoder
FAST = EngineConfig(chunker="fixed_sentence", retrieval=RetrievalConfig(candidates=8, rerank=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scripted:
    """An LLM that replies with fixed texts in order and records its prompts: for control-flow tests only, where the
    test needs a reader that said a given thing."""

    name = "scripted"

    def __init__(self, replies):
        self.replies, self.prompts = list(replies), []

    def generate(self, messages, *, max_new_tokens=32, temperature=0.0, seed=None):
        from certrag.llm.local import Generation

        self.prompts.append(messages)
        text = self.replies.pop(0)
        return Generation(text=text, input_tokens=50, output_tokens=3, seconds=0.0, finish_reason="stop")
