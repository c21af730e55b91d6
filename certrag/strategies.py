"""Answering strategies behind one interface: plain RAG, Chain-of-Note, and SAGE's self-feedback loop.

A strategy turns (question, passages) into a StrategyResult using an LLM with ``generate(messages, ...) ->
Generation``; every call is kept so that tokens and cost add up over all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Protocol

from certrag.llm.local import Generation
from certrag.llm.prompts import (Passage, chain_of_note_messages, feedback_messages, note_messages,
                                 noted_answer_messages, plain_messages)

NOTE_KINDS = ("answers", "context", "irrelevant")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Note:
    passage: int  # 1-based, as in the prompt; -1 when the note names no passage
    kind: str  # answers | context | irrelevant | malformed
    text: str


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


class LLM(Protocol):
    def generate(self, messages: list[dict], *, max_new_tokens: int = ..., temperature: float = ...,
                 seed: int | None = ...) -> Generation: ...


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        line = line.strip()
        if line:
            return re.sub(r"^(answer|final answer)\s*:\s*", "", line, flags=re.I).strip()
    return ""


@dataclass(frozen=True)
class Plain:
    """Standard RAG (Lewis et al., 2020): passages in the prompt, a short answer out."""

    max_new_tokens: int = 32
    name: str = "plain"

    def run(self, question: str, passages: list[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None) -> StrategyResult:
        g = llm.generate(plain_messages(question, passages, qtype, options), max_new_tokens=self.max_new_tokens)
        return StrategyResult(text=_first_line(g.text), calls=(g,), passages_used=len(passages))


_NOTE = re.compile(r"^\s*(?:\*\*)?note\s*(\d+)?\s*(?:\[([a-z_ ]+)\]|\(([a-z_ ]+)\))?\s*:?\s*(.*)$", re.I)
_ANSWER = re.compile(r"^\s*(?:\*\*)?(?:final\s+)?answer(?:\*\*)?\s*:\s*(.*)$", re.I)


def _kind(label: str, text: str) -> str:
    probe = (label or "").lower() or text.lower()[:60]
    if "irrelevant" in probe or "not relevant" in probe:
        return "irrelevant"
    if "context" in probe or "infer" in probe:
        return "context"
    if "answer" in probe or "states" in probe:
        return "answers"
    return "malformed"


def parse_chain_of_note(output: str, n_passages: int) -> tuple[tuple[Note, ...], str, bool]:
    """Returns (notes, answer, malformed). Never raises: what cannot be parsed is reported as malformed."""
    notes, answer, malformed = [], None, False
    for line in output.splitlines():
        m = _ANSWER.match(line)
        if m:
            answer = m.group(1).strip().strip("*").strip()
            continue
        m = _NOTE.match(line)
        if m and line.strip().lower().lstrip("*").startswith("note"):
            idx = int(m.group(1)) if m.group(1) else len(notes) + 1
            label = m.group(2) or m.group(3) or ""
            kind = _kind(label, m.group(4))
            if kind == "malformed" or not 1 <= idx <= max(n_passages, 1):
                malformed = True
            notes.append(Note(passage=idx if 1 <= idx <= n_passages else -1, kind=kind, text=m.group(4).strip()))
    if answer is None:
        malformed = True
        answer = _first_line(output.splitlines()[-1]) if output.strip() else UNKNOWN
    if len(notes) != n_passages:
        malformed = True
    return tuple(notes), answer, malformed


def is_unknown(answer: str) -> bool:
    a = answer.strip().lower().strip(".!")
    return a in ("unknown", "i don't know", "i do not know", "no answer", "") or a.startswith("unknown")


_NOTE_KIND = re.compile(r"^[\s*#>-]*(?:reading\s+)?(?:note\s*\d*\s*)?[\[(]?\s*(answers?|context|irrelevant)\b"
                        r"[\s*\])]*[:-]?[\s*]*(.*)$", re.I)


def parse_note(output: str) -> tuple[str, str, bool]:
    """(kind, note, malformed) from a one-passage reading note: its first non-empty line must start with ANSWERS,
    CONTEXT or IRRELEVANT. Never raises; a note without a kind is 'malformed'."""
    for line in output.splitlines():
        if line.strip():
            m = _NOTE_KIND.match(line)
            if not m:
                return "malformed", line.strip(), True
            kind = m.group(1).lower()
            return ("answers" if kind.startswith("answer") else kind), m.group(2).strip(), False
    return "malformed", "", True


def generate_all(llm: LLM, messages_list: list[list[dict]], max_new_tokens: int) -> list[Generation]:
    """One generation per chat: batched when the backend can (LocalLLM.generate_batch), else one by one."""
    batch = getattr(llm, "generate_batch", None)
    if batch is not None:
        return list(batch(messages_list, max_new_tokens=max_new_tokens))
    return [llm.generate(m, max_new_tokens=max_new_tokens) for m in messages_list]


@dataclass(frozen=True)
class ChainOfNote:
    """Chain-of-Note (Yu et al., 2023): a reading note per passage (answers / context / irrelevant), then the
    answer or 'unknown'. An 'unknown' answer counts as a rejection.

    mode "per_passage" (default): one note per passage, each its own short call (batched on a local model), then
    the answer from the passages not noted irrelevant, each with its note; when every passage is irrelevant the
    answer is 'unknown' with no further call. A note without a kind is reported (malformed) and its passage kept.
    mode "single": the paper's layout, every note and the answer in one generation -- for models that follow a
    multi-part format (the bundled 0.5B reader does not: it skips the notes; bench_qa.py).
    max_new_tokens: per note (per passage in "single" mode, plus the answer line)."""

    max_new_tokens: int = 40
    mode: str = "per_passage"
    answer_tokens: int = 32
    name: str = "chain_of_note"

    def run(self, question: str, passages: list[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None) -> StrategyResult:
        if self.mode not in ("per_passage", "single"):
            raise ValueError(f"mode must be 'per_passage' or 'single'; got {self.mode!r}")
        if self.mode == "single":
            budget = self.max_new_tokens * (len(passages) + 1)
            g = llm.generate(chain_of_note_messages(question, passages, qtype, options), max_new_tokens=budget)
            notes, answer, malformed = parse_chain_of_note(g.text, len(passages))
            rejected = is_unknown(answer)
            return StrategyResult(text=UNKNOWN if rejected else answer, calls=(g,), notes=notes, rejected=rejected,
                                  malformed=malformed, passages_used=len(passages))
        gens = generate_all(llm, [note_messages(question, p) for p in passages], self.max_new_tokens)
        notes, keep, malformed = [], [], False
        for i, g in enumerate(gens, 1):
            kind, text, bad = parse_note(g.text)
            notes.append(Note(passage=i, kind=kind, text=text))
            malformed |= bad
            if kind != "irrelevant":
                keep.append(i - 1)
        if passages and not keep:  # every passage noted irrelevant: an honest 'unknown', no answer call
            return StrategyResult(text=UNKNOWN, calls=tuple(gens), notes=tuple(notes), rejected=True,
                                  malformed=malformed, passages_used=len(passages), cited=(), answer_call=None)
        lines = [n.text if n.kind == "malformed" else f"{n.kind.upper()}: {n.text}" for n in notes]
        final = llm.generate(noted_answer_messages(question, [passages[i] for i in keep], [lines[i] for i in keep],
                                                   qtype, options), max_new_tokens=self.answer_tokens)
        answer = _first_line(final.text)
        rejected = is_unknown(answer)
        return StrategyResult(text=UNKNOWN if rejected else answer, calls=(*gens, final), notes=tuple(notes),
                              rejected=rejected, malformed=malformed, passages_used=len(passages), cited=tuple(keep),
                              answer_call=len(gens))


_SCORE = re.compile(r"score\s*:?\s*(\d+(?:\.\d+)?)", re.I)
_FLAG = re.compile(r"context\s*:?\s*([+-]?\s*1)\b", re.I)


def parse_feedback(text: str) -> tuple[float | None, int]:
    """(score 1-10 or None when absent, flag -1 / +1 / 0 when absent)."""
    s = _SCORE.search(text)
    f = _FLAG.search(text)
    score = min(10.0, max(1.0, float(s.group(1)))) if s else None
    flag = 0
    if f:
        flag = -1 if f.group(1).replace(" ", "").startswith("-") else 1
    return score, flag


@dataclass(frozen=True)
class Feedback:
    """SAGE's self-feedback loop (Wang et al., 2025, section 3.3) around any strategy: after each answer the LLM
    scores it 1-10 and flags the context -1 (too much) or +1 (too little); a score at or above `threshold` ends the
    loop, otherwise min_k moves by the flag and the question is answered again, for at most `max_rounds` rounds.
    Every round's tokens count. Without a usable score the loop stops (the answer stands)."""

    base: object = field(default_factory=Plain)
    threshold: float = 9.0
    max_rounds: int = 3
    max_new_tokens: int = 16
    name: str = "feedback"

    def run_adaptive(self, question: str, retrieve: Callable[[int], list[Passage]], llm: LLM, min_k: int,
                     qtype: str = "open", options: list[str] | None = None, max_k: int = 10) -> StrategyResult:
        if self.max_rounds < 1:
            raise ValueError("max_rounds must be at least 1")
        calls, history, result, answer_call = [], [], None, 0
        k = min_k
        for round_no in range(1, self.max_rounds + 1):
            passages = retrieve(k)
            result = self.base.run(question, passages, llm, qtype, options)
            answer_call = None if result.answer_call is None else len(calls) + result.answer_call
            calls += result.calls
            judge = llm.generate(feedback_messages(question, passages, result.text),
                                 max_new_tokens=self.max_new_tokens)
            calls.append(judge)
            score, flag = parse_feedback(judge.text)
            history.append({"round": round_no, "min_k": k, "passages": len(passages), "answer": result.text,
                            "score": score, "flag": flag})
            if score is None or score >= self.threshold or flag == 0:
                break
            new_k = min(max_k, max(1, k + flag))
            if new_k == k:
                break
            k = new_k
        return StrategyResult(text=result.text, calls=tuple(calls), notes=result.notes, rejected=result.rejected,
                              malformed=result.malformed, rounds=len(history), passages_used=result.passages_used,
                              history=tuple(history), answer_call=answer_call, cited=result.cited)


def _self_rag(max_new_tokens: int | None = None, **kwargs):
    from certrag.selfrag import SelfRag

    if max_new_tokens is not None:
        kwargs["segment_tokens"] = max_new_tokens
    return SelfRag(**kwargs)


STRATEGIES = {"plain": Plain, "chain_of_note": ChainOfNote, "self_rag": _self_rag}
