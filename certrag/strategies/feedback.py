"""SAGE's self-feedback loop (Wang et al., 2025, section 3.3): the LLM judges its own answer and widens or narrows
the context."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Sequence

from certrag.llm.prompts import FLAG_PROMPT, FLAG_WORDS, Passage, feedback_messages
from certrag.strategies.base import LLM, Selection, Strategy, StrategyResult, generate
from certrag.strategies.plain import Plain


_SCORE = re.compile(r"score[\s:*=]{0,6}(\d+(?:\.\d+)?)", re.I)
_FLAG = re.compile(r"context[\s:*=]{0,6}([+-]?\s*[01])\b", re.I)
_WORD_FLAG = re.compile(r"passages[\s:*=]{0,6}['\"]?(more|fewer|less|same)\b", re.I)
_WORDS = {**FLAG_WORDS, "less": -1}
_ECHO = re.compile(r"\b(?:more|fewer|same) if (?:the passages|there were|they were)", re.I)
_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?!\.?\d)")


def parse_feedback(text: str) -> tuple[float | None, int | None]:
    """(score clipped to 1-10, or None when the text holds none; flag -1 / 0 / +1, or None when absent). The score
    is the number after "Score", else the reply's first number when it opens the reply (a bare "7"); the flag is
    the word after "Passages" (more +1, fewer -1, same 0: what the prompt asks for; not when the line echoes the
    instruction, "Passages: more if the passages were too few ...") or the signed digit after "Context"."""
    s = _SCORE.search(text)
    if s is None:
        s = _NUMBER.match(text.strip().lstrip("*#").strip())
    f = _FLAG.search(text)
    w = _WORD_FLAG.search(text)
    score = min(10.0, max(1.0, float(s.group(1)))) if s else None
    flag = None
    if w and not _ECHO.search(text[w.start():]):  # a flag line that echoes the instruction is no judgment
        flag = _WORDS[w.group(1).lower()]
    elif f:
        digit = f.group(1).replace(" ", "")
        flag = 0 if digit.lstrip("+-") == "0" else (-1 if digit.startswith("-") else 1)
    return score, flag


def flag_from_probabilities(llm, messages: list[dict], reply: str) -> int | None:
    """The context flag the model gives most probability to when its reply goes on with the flag line: the next
    token after `reply` + newline + "Passages:" among the first tokens of " more", " fewer", " same" (a TokenLLM:
    the local model); None for a model without token probabilities, or when the three words share a first token."""
    from certrag.protocols import TokenLLM

    if not isinstance(llm, TokenLLM):
        return None
    tok = llm.tokenizer
    firsts = [tok(f" {w}", add_special_tokens=False)["input_ids"][0] for w in FLAG_WORDS]
    if len(set(firsts)) != len(firsts):
        return None
    lead = reply.rstrip()
    if FLAG_PROMPT.lower() in lead.lower():
        lead = lead[: lead.lower().index(FLAG_PROMPT.lower())].rstrip()
    ids = llm.prompt_ids(messages) + tok((lead + "\n" if lead else "") + FLAG_PROMPT,
                                         add_special_tokens=False)["input_ids"]
    probs = llm.next_token_probs([ids], firsts)[0]
    return list(FLAG_WORDS.values())[int(max(range(len(firsts)), key=lambda i: probs[i]))]


@dataclass(frozen=True)
class Feedback:
    """SAGE's self-feedback loop (Wang et al., 2025, section 3.3) around any strategy: after each answer the LLM
    scores it 1-10 and flags the context -1 (too much), +1 (too little) or 0 (right); a score above `threshold`
    (the paper's "higher than 9") ends the loop, otherwise min_k moves by the flag and the question is answered
    again, for at most `max_rounds` rounds, each judged (three rounds, three judgments; every round's tokens
    count). Without a usable score, or with flag 0, the loop stops (the answer stands). The flag is the model's: the
    word it writes on its flag line, or, when it leaves the line out, the word it gives most probability to there
    (flag_from_probabilities: a local model); only a model with neither moves min_k by `default_flag`. The
    history records each round's flag and where it came from (flag_source: generated / probabilities / default).

    The context of each round comes from `selection` (the engine's: the gradient selector's cut of the same
    reranked candidates with min_k moved); without one, from the given passages (all of them first, then the first
    min_k). Compose it with any strategy: Feedback(ChainOfNote())."""

    base: Strategy = field(default_factory=Plain)
    threshold: float = 9.0
    max_rounds: int = 3
    max_new_tokens: int = 24  # the judge's budget
    default_flag: int = 1

    @property
    def name(self) -> str:
        base = getattr(self.base, "name", "plain")
        return "feedback" if base == "plain" else f"feedback:{base}"

    def with_max_new_tokens(self, n: int) -> "Feedback":
        """n is the answering strategy's budget; the judge's stays."""
        return dataclasses.replace(self, base=self.base.with_max_new_tokens(n))

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        if self.max_rounds < 1:
            raise ValueError("max_rounds must be at least 1")
        if self.default_flag not in (-1, 0, 1):
            raise ValueError(f"default_flag must be -1, 0 or 1; got {self.default_flag!r}")
        selection = selection or Selection.fixed(passages)
        calls, history, result, answer_call = [], [], None, 0
        k = selection.min_k
        for round_no in range(1, self.max_rounds + 1):
            context = list(selection.passages(k))
            result = self.base.run(question, context, llm, qtype, options, record_lookback=record_lookback)
            answer_call = None if result.answer_call is None else len(calls) + result.answer_call
            calls += result.calls
            entry = {"round": round_no, "min_k": k, "passages": len(context), "answer": result.text}
            messages = feedback_messages(question, context, result.text)
            judge = generate(llm, messages, max_new_tokens=self.max_new_tokens)
            calls.append(judge)
            score, flag = parse_feedback(judge.text)
            source = "generated"
            if flag is None:
                flag, source = flag_from_probabilities(llm, messages, judge.text), "probabilities"
            if flag is None:
                flag, source = self.default_flag, "default"
            history.append({**entry, "score": score, "flag": flag, "flag_source": source,
                            "flag_defaulted": source == "default", "judged": True, "judge": judge.text})
            if round_no == self.max_rounds or score is None or score > self.threshold or flag == 0:
                break
            new_k = min(selection.max_k, max(1, k + flag))
            if new_k == k:
                break
            k = new_k
        return StrategyResult(text=result.text, calls=tuple(calls), notes=result.notes, rejected=result.rejected,
                              malformed=result.malformed, rounds=len(history), passages_used=result.passages_used,
                              history=tuple(history), answer_call=answer_call, cited=result.cited)
