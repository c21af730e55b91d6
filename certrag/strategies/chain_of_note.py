"""Chain-of-Note (Yu et al., 2023): a reading note per passage (answers / context / irrelevant), then the answer or
'unknown' when nothing supports one."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

from certrag.llm.prompts import Passage, chain_of_note_messages, note_messages, noted_answer_messages
from certrag.strategies.base import (LLM, UNKNOWN, Note, Selection, StrategyResult, first_line, generate,
                                     generate_all, is_unknown)


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
        answer = first_line(output.splitlines()[-1]) if output.strip() else UNKNOWN
    if len(notes) != n_passages:
        malformed = True
    return tuple(notes), answer, malformed


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

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        passages = list(passages)
        if self.mode not in ("per_passage", "single"):
            raise ValueError(f"mode must be 'per_passage' or 'single'; got {self.mode!r}")
        if self.mode == "single":
            budget = self.max_new_tokens * (len(passages) + 1)
            g = generate(llm, chain_of_note_messages(question, passages, qtype, options), max_new_tokens=budget,
                         record_lookback=record_lookback)
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
        final = generate(llm, noted_answer_messages(question, [passages[i] for i in keep], [lines[i] for i in keep],
                                                    qtype, options), max_new_tokens=self.answer_tokens,
                         record_lookback=record_lookback)
        answer = first_line(final.text)
        rejected = is_unknown(answer)
        return StrategyResult(text=UNKNOWN if rejected else answer, calls=(*gens, final), notes=tuple(notes),
                              rejected=rejected, malformed=malformed, passages_used=len(passages), cited=tuple(keep),
                              answer_call=len(gens))

    def with_max_new_tokens(self, n: int) -> "ChainOfNote":
        """n is the budget of each note (per passage in "single" mode)."""
        return dataclasses.replace(self, max_new_tokens=n)
