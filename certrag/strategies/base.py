"""What every answering strategy shares: the interface, the result, reading notes, and the helpers that call the LLM.

A strategy turns (question, passages) into a StrategyResult with an LLM that has ``generate(messages, ...) ->
Generation``; every call is kept so that tokens and cost add up over all of them. One interface for all of them:

    strategy.run(question, passages, llm, qtype="open", options=None, *, selection=None, record_lookback=False)

``selection`` lets a strategy change how much context it reads (SAGE's feedback loop moves min_k): passages(min_k)
re-selects from the same reranked candidates. ``record_lookback`` asks the call that writes the answer to record
lookback ratios (its Generation.lookback; StrategyResult.answer_call says which call that is). Both are per call:
no strategy or LLM holds a per-request flag. ``with_max_new_tokens(n)`` returns the strategy with its answer budget
set to n.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from certrag.llm.local import Generation
from certrag.llm.prompts import Passage

NOTE_KINDS = ("answers", "context", "irrelevant")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Note:
    passage: int  # 1-based, as in the prompt; -1 when the note names no passage
    kind: str  # answers | context | irrelevant | malformed
    text: str
    claimed: str = ""  # the kind the model wrote, before Chain-of-Note checked it against the passage (check_note)


@dataclass(frozen=True)
class StrategyResult:
    text: str
    calls: tuple[Generation, ...]
    notes: tuple[Note, ...] = ()
    rejected: bool = False
    malformed: bool = False  # the model's output did not follow the requested format
    rounds: int = 1
    passages_used: int = 0
    history: tuple[dict, ...] = ()
    cited: tuple[int, ...] | None = None  # 0-based passage indices the answer rests on, when the strategy knows
    answer_call: int | None = 0  # index in calls of the generation that wrote the answer (None: no single one)

    @property
    def input_tokens(self) -> int:
        return sum(c.input_tokens for c in self.calls)

    @property
    def output_tokens(self) -> int:
        return sum(c.output_tokens for c in self.calls)


@dataclass(frozen=True)
class Selection:
    """How the context may widen or narrow within one answer: passages(min_k) is the selector's cut of the same
    reranked candidates with min_k moved (SAGE's gradient rule), min_k the first round's, max_k the most it gives."""

    passages: Callable[[int], Sequence[Passage]]
    min_k: int
    max_k: int

    @classmethod
    def fixed(cls, passages: Sequence[Passage]) -> "Selection":
        """A selection over a fixed list: the first min_k passages, starting from all of them."""
        passages = list(passages)
        return cls(passages=lambda k: passages[:k], min_k=len(passages), max_k=len(passages))


class LLM(Protocol):
    def generate(self, messages: list[dict], *, max_new_tokens: int = ..., temperature: float = ...,
                 seed: int | None = ...) -> Generation: ...


class Strategy(Protocol):
    name: str

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult: ...

    def with_max_new_tokens(self, n: int) -> "Strategy": ...


def generate(llm: LLM, messages: list[dict], *, max_new_tokens: int, record_lookback: bool = False,
             **kwargs) -> Generation:
    """One LLM call; record_lookback is passed only when asked for, so any backend with the plain generate()
    signature serves every call that does not record."""
    if record_lookback:
        kwargs["record_lookback"] = True
    return llm.generate(messages, max_new_tokens=max_new_tokens, **kwargs)


def generate_all(llm: LLM, messages_list: list[list[dict]], max_new_tokens: int, *, prefix: str = "",
                 record_lookback: bool = False) -> list[Generation]:
    """One generation per chat, in order, decoded together where the backend can (LocalLLM.submit: its engine
    batches them, and a greedy chat's tokens are exactly those it gets alone), else one by one. prefix and
    record_lookback apply to every chat and are passed only when set, so a backend with the plain generate()
    signature serves the calls that use neither."""
    kwargs: dict = {"prefix": prefix} if prefix else {}
    if record_lookback:
        kwargs["record_lookback"] = True
    submit = getattr(llm, "submit", None)
    if submit is not None:
        pending = [submit(m, max_new_tokens=max_new_tokens, **kwargs) for m in messages_list]
        return [p.result() for p in pending]
    batch = getattr(llm, "generate_batch", None)
    if batch is not None and not kwargs:
        return list(batch(messages_list, max_new_tokens=max_new_tokens))
    return [llm.generate(m, max_new_tokens=max_new_tokens, **kwargs) for m in messages_list]


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        line = line.strip()
        if line:
            return re.sub(r"^(answer|final answer)\s*:\s*", "", line, flags=re.I).strip()
    return ""


_REFUSAL = re.compile(
    r"^(?:the\s+answer\s+is\s+)?(?:unknown|not\s+known|i\s+(?:do\s+not|don'?t|cannot|can'?t)\s+(?:know|tell|say)|"
    r"no\s+answer|(?:it\s+)?cannot\s+be\s+(?:determined|answered)|not\s+(?:stated|mentioned|given|provided)"
    r"(?:\s+in\s+the\s+passages?)?)(?:\s*$|\s*[.!,;:(\[\-\u2013\u2014])", re.I)


def is_unknown(answer: str) -> bool:
    """Whether an answer is a refusal: it *is* "unknown" (or "I don't know", "no answer", "cannot be determined",
    "not stated in the passages", optionally after "the answer is"), alone or followed by punctuation and an
    explanation. An answer that merely starts with the word ("Unknown Soldier") is an answer, and an empty one is
    malformed, not a refusal."""
    a = answer.strip().strip("\"'*`").strip()
    return bool(a) and _REFUSAL.match(a) is not None
