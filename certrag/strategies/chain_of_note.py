"""Chain-of-Note (Yu et al., 2023): a reading note per passage (answers / context / irrelevant), then the answer or
'unknown' when nothing supports one."""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

from certrag.llm.prompts import (CON_PREFIX, Passage, answer_line_messages, chain_of_note_messages,
                                 closed_book_messages, note_messages, noted_answer_messages)
from certrag.protocols import TokenLLM
from certrag.strategies.base import (LLM, UNKNOWN, Note, Selection, StrategyResult, first_line, generate,
                                     generate_all, is_unknown)


_NOTE = re.compile(r"^[\s*#>-]*(?:note|passage)\s*(\d+)?\s*(?:\[([a-z_ |]+)\]|\(([a-z_ |]+)\))?\s*[:.-]?\s*(.*)$", re.I)
_ANSWER = re.compile(r"^\s*(?:\*\*)?(?:final\s+)?answer(?:\*\*)?\s*:\s*(.*)$", re.I)
_IRRELEVANT = re.compile(r"\b(?:irrelevant|not\s+relevant|no\s+relevan|unrelated|does\s+not\s+(?:help|mention|"
                         r"answer|say)|doesn't\s+(?:help|mention|answer|say))|^\W*no\b", re.I)
_ANSWERS = re.compile(r"\b(?:answers\s+the\s+question|states\s+the\s+answer|gives\s+the\s+answer|"
                      r"contains\s+the\s+answer|answers)\b", re.I)
_CONTEXT = re.compile(r"\b(?:context|relevant|infer|background|related)\b|^\W*yes\b", re.I)


def _kind(label: str, text: str) -> str:
    """A note's kind from its label ("[ANSWERS]") or, without one, from the words of its verdict: irrelevant before
    answers before context, so "not relevant" is not read as "relevant". A note that gives no verdict at all
    (it only says what the passage is about) is context: the model kept it to answer from."""
    probe = (label or "").lower() if label and "|" not in label else text[:160]
    if _IRRELEVANT.search(probe):
        return "irrelevant"
    if _ANSWERS.search(probe):
        return "answers"
    if _CONTEXT.search(probe):
        return "context"
    return "context" if text.strip() and not label else "malformed"


def parse_chain_of_note(output: str, n_passages: int) -> tuple[tuple[Note, ...], str, bool]:
    """Returns (notes, answer, malformed) from one Chain-of-Note generation: a line per passage ("Passage 2: ..."
    or "Note 2 [IRRELEVANT]: ..."), then "Answer: ...". Malformed: a note missing, out of range or without a
    readable kind, or no answer line. Never raises."""
    notes, answer, malformed = [], None, False
    for line in output.splitlines():
        m = _ANSWER.match(line)
        if m:
            answer = m.group(1).strip().strip("*").strip()
            continue
        m = _NOTE.match(line)
        if m and re.match(r"^[\s*#>-]*(?:note|passage)\b", line, re.I):
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


def has_answer_line(output: str) -> bool:
    """Whether a Chain-of-Note generation wrote its answer line ("Answer: ..."), as parse_chain_of_note reads it."""
    return any(_ANSWER.match(line) for line in output.splitlines())


_NOTE_KIND = re.compile(r"^[\s*#>-]*(?:reading\s+)?(?:note\s*\d*\s*)?[\[(]?\s*(answers?|context|irrelevant)\b"
                        r"[\s*\])]*[:-]?[\s*]*(.*)$", re.I)


_STOP = frozenset("""a an the of in on at to for from by with and or but is are was were be been being it its this that
these those which who whom whose what when where why how as than then there their they them he she
his her we you i not no yes do does did has have had will would can could should may might also
about into over under after before during passage note answer answers states stated question context
irrelevant says said first last""".split())
_WORD = re.compile(r"[a-z0-9]+")


def _content(text: str) -> set[str]:
    """Content words: lower-cased, accents stripped, alphanumeric runs, without stop words and short words."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return {w for w in _WORD.findall(plain) if w not in _STOP and (len(w) > 2 or w.isdigit())}


def check_note(kind: str, note: str, passage: str, question: str) -> str:
    """The kind a note may keep, checked against the passage it is about (a small reader writes ANSWERS for
    passages that do not hold the answer at all -- on Python documentation, 'the Eagles won in 2004' -- and the
    answer step then repeats it):

    - ANSWERS stands when the words the note adds to the question (its answer) occur in the passage: every number
      (years and counts are what a small reader invents) and at least half of the other words. Otherwise the note
      is demoted: to CONTEXT if the passage shares words with the question, else to IRRELEVANT.
    - CONTEXT stands when the passage shares at least a quarter of the question's content words (at least one);
      otherwise it is IRRELEVANT.
    Words are lower-cased alphanumeric runs without stop words; a malformed or irrelevant note is returned as it
    is."""
    if kind not in ("answers", "context"):
        return kind
    q, p = _content(question), _content(passage)
    shares = bool(q) and len(q & p) >= max(1, -(-len(q) // 4))
    if kind == "answers":
        added = _content(note) - q
        numbers, words = {w for w in added if w.isdigit()}, {w for w in added if not w.isdigit()}
        if added and numbers <= p and 2 * len(words & p) >= len(words):
            return "answers"
    return "context" if shares else "irrelevant"


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

    mode "single" (default): the paper's method, one generation per question -- the notes on d1..dk in order, each
    seeing the ones before, then the answer (certrag.llm.prompts.chain_of_note_messages; a local model's text is
    started with the first note's "Passage 1:"). The notes are the model's own: nothing relabels them. Notes that end
    without the answer line (the budget ran out) are followed by a short call that asks for it (_answer_after).
    mode "per_passage": one note per passage, each its own short call (batched on a local model), then the answer
    from the passages not noted irrelevant, each with its note; when every passage is noted irrelevant (or there are
    none) the model is asked once more without them (fallback=True): it answers from what it knows or says
    'unknown'. A note without a kind is reported (malformed) and its passage kept. check_notes=True holds each
    ANSWERS or CONTEXT note to its passage (check_note, lexical): a note whose answer the passage does not contain
    is demoted (the model's own label stays in Note.claimed). Not the paper's; kept for small readers that cannot
    write the one-pass format (the 0.5B reader), measured in bench_qa.
    max_new_tokens: per note (per passage in "single" mode, plus the answer line)."""

    max_new_tokens: int = 40
    mode: str = "single"
    answer_tokens: int = 32
    fallback: bool = True
    check_notes: bool = False
    name: str = "chain_of_note"

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        passages = list(passages)
        if self.mode not in ("per_passage", "single"):
            raise ValueError(f"mode must be 'per_passage' or 'single'; got {self.mode!r}")
        if self.mode == "single":
            budget = self.max_new_tokens * (len(passages) + 1)
            started = CON_PREFIX if passages and isinstance(llm, TokenLLM) else ""
            kwargs = {"prefix": started} if started else {}
            messages = chain_of_note_messages(question, passages, qtype, options)
            g = generate(llm, messages, max_new_tokens=budget, record_lookback=record_lookback, **kwargs)
            written, calls = f"{started}{g.text}", (g,)
            if not has_answer_line(written):
                # the notes ran out of budget (or the model stopped) before the answer line: the answer is asked for
                # after the notes as written, never read from the last, cut note
                g2 = self._answer_after(llm, messages, written, record_lookback)
                # first_line: a chat backend may write the line whole ("Answer: Paris"); a local model continues it
                written, calls = f"{written.rstrip()}\nAnswer: {first_line(g2.text)}", (g, g2)
            notes, answer, malformed = parse_chain_of_note(written, len(passages))
            rejected = is_unknown(answer)
            malformed |= not answer.strip()
            return StrategyResult(text=UNKNOWN if rejected else answer, calls=calls, notes=notes, rejected=rejected,
                                  malformed=malformed, passages_used=len(passages), answer_call=len(calls) - 1)
        gens = generate_all(llm, [note_messages(question, p) for p in passages], self.max_new_tokens)
        notes, keep, malformed = [], [], False
        for i, g in enumerate(gens, 1):
            claimed, text, bad = parse_note(g.text)
            kind = check_note(claimed, text, passages[i - 1].text, question) if self.check_notes else claimed
            notes.append(Note(passage=i, kind=kind, text=text, claimed=claimed))
            malformed |= bad
            if kind != "irrelevant":
                keep.append(i - 1)
        if not keep:  # nothing the notes can use: what the model knows without them, or 'unknown'
            if not self.fallback:
                return StrategyResult(text=UNKNOWN, calls=tuple(gens), notes=tuple(notes), rejected=True,
                                      malformed=malformed, passages_used=len(passages), cited=(), answer_call=None)
            # no passages in the prompt, so no lookback ratios to record (answer_call None: no confidence)
            alone = generate(llm, closed_book_messages(question, qtype, options), max_new_tokens=self.answer_tokens)
            answer = first_line(alone.text)
            rejected = is_unknown(answer)
            return StrategyResult(text=UNKNOWN if rejected else answer, calls=(*gens, alone), notes=tuple(notes),
                                  rejected=rejected, malformed=malformed or not answer, passages_used=len(passages),
                                  cited=(), answer_call=None, history=({"fallback": "closed_book"},))
        lines = [n.text if n.kind == "malformed" else f"{n.kind.upper()}: {n.text}" for n in notes]
        final = generate(llm, noted_answer_messages(question, [passages[i] for i in keep], [lines[i] for i in keep],
                                                    qtype, options), max_new_tokens=self.answer_tokens,
                         record_lookback=record_lookback)
        answer = first_line(final.text)
        rejected = is_unknown(answer)
        return StrategyResult(text=UNKNOWN if rejected else answer, calls=(*gens, final), notes=tuple(notes),
                              rejected=rejected, malformed=malformed, passages_used=len(passages), cited=tuple(keep),
                              answer_call=len(gens))

    def _answer_after(self, llm: LLM, messages: list[dict], written: str, record_lookback: bool):
        """The answer line's generation after notes that lack one: a local model continues its own text from
        "Answer:"; a chat backend gets the notes back as its turn and is asked for the line."""
        if isinstance(llm, TokenLLM):
            return generate(llm, messages, max_new_tokens=self.answer_tokens, record_lookback=record_lookback,
                            prefix=f"{written.rstrip()}\nAnswer:")
        return generate(llm, answer_line_messages(messages, written), max_new_tokens=self.answer_tokens,
                        record_lookback=record_lookback)

    def with_max_new_tokens(self, n: int) -> "ChainOfNote":
        """n is the budget of each note (per passage in "single" mode)."""
        return dataclasses.replace(self, max_new_tokens=n)
