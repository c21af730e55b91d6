"""Standard RAG (Lewis et al., 2020): the passages in the prompt, a short answer out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from certrag.llm.prompts import Passage, plain_messages
from certrag.strategies.base import LLM, Selection, StrategyResult, first_line, generate


@dataclass(frozen=True)
class Plain:
    """Standard RAG (Lewis et al., 2020): passages in the prompt, a short answer out."""

    max_new_tokens: int = 32
    name: str = "plain"

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        g = generate(llm, plain_messages(question, list(passages), qtype, options),
                     max_new_tokens=self.max_new_tokens, record_lookback=record_lookback)
        return StrategyResult(text=first_line(g.text), calls=(g,), passages_used=len(passages))

    def with_max_new_tokens(self, n: int) -> "Plain":
        return dataclasses.replace(self, max_new_tokens=n)
