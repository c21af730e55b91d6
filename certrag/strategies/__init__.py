"""Answering strategies, one room per paper, behind one interface (certrag.strategies.base.Strategy):

plain.py           standard RAG (Lewis et al., 2020)
chain_of_note.py   Chain-of-Note (Yu et al., 2023): a reading note per passage, an honest "unknown"
feedback.py        SAGE's self-feedback loop (Wang et al., 2025) around any other strategy
self_rag.py        Self-RAG (Asai et al., 2024): reflection scores, adaptive retrieval, segment beam search

The one registry of names: the engine, the CLI, the server and the evaluation harness all resolve names here.
"""

from __future__ import annotations

from certrag.strategies.base import (LLM, NOTE_KINDS, UNKNOWN, Note, Selection, Strategy, StrategyResult, first_line,
                                     generate_all, is_unknown)
from certrag.strategies.chain_of_note import ChainOfNote, parse_chain_of_note, parse_note
from certrag.strategies.feedback import Feedback, parse_feedback
from certrag.strategies.plain import Plain
from certrag.strategies.self_rag import SelfRag

STRATEGIES = {"plain": Plain, "chain_of_note": ChainOfNote, "self_rag": SelfRag, "feedback": Feedback}
"""Name -> strategy class; each builds with its defaults."""

STRATEGY_NAMES = (*STRATEGIES, *(f"feedback:{name}" for name in STRATEGIES if name not in ("feedback", "plain")))
"""Every name make_strategy takes: the strategies, and the feedback loop around each other one ("feedback" alone is
the loop around plain)."""


def make_strategy(spec: str | Strategy) -> Strategy:
    """A strategy from its name (one of STRATEGY_NAMES; "feedback:<name>" is Feedback(<name>'s strategy)), or the
    object itself when it already is one (anything with run(...))."""
    if not isinstance(spec, str):
        if not callable(getattr(spec, "run", None)):
            raise ValueError(f"strategy must be a name or an object with a run method; got {spec!r}")
        return spec
    if spec not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_NAMES)}; got {spec!r}")
    loop, _, base = spec.partition(":")
    if loop == "feedback" and base:
        return Feedback(base=STRATEGIES[base]())
    return STRATEGIES[spec]()


__all__ = ["ChainOfNote", "Feedback", "LLM", "NOTE_KINDS", "Note", "Plain", "STRATEGIES", "STRATEGY_NAMES",
           "Selection", "SelfRag", "Strategy", "StrategyResult", "UNKNOWN", "first_line", "generate_all",
           "is_unknown", "make_strategy", "parse_chain_of_note", "parse_feedback", "parse_note"]
