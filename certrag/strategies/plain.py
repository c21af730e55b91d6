"""Standard RAG (Lewis et al., 2020): the passages in the prompt, a short answer out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from certrag.llm.prompts import Passage, plain_messages
from certrag.strategies.base import LLM, UNKNOWN, Selection, StrategyResult, first_line, generate, is_unknown


@dataclass(frozen=True)
class Plain:
    """Standard RAG (Lewis et al., 2020): passages in the prompt, a short answer out -- or "unknown", the same way
    out every strategy's prompt offers, read by the same rule (is_unknown) as a rejection."""

    max_new_tokens: int = 32
    name: str = "plain"

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        g = generate(llm, plain_messages(question, list(passages), qtype, options),
                     max_new_tokens=self.max_new_tokens, record_lookback=record_lookback)
        text = first_line(g.text)
        rejected = is_unknown(text)
        return StrategyResult(text=UNKNOWN if rejected else text, calls=(g,), rejected=rejected,
                              malformed=not text, passages_used=len(passages))

    def with_max_new_tokens(self, n: int) -> "Plain":
        return dataclasses.replace(self, max_new_tokens=n)
