"""QA metrics as DPR computes them (Karpukhin et al., 2020): answers are lower-cased, stripped of punctuation and of
the articles a / an / the, and whitespace-normalised before comparison (certrag.textnorm)."""

from __future__ import annotations

from collections import Counter

from certrag.textnorm import normalize_answer

__all__ = ["answer_in_text", "exact_match", "f1_score", "normalize_answer", "substring_match"]


def exact_match(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Token-level F1 between the normalised prediction and the best-matching gold answer."""
    best = 0.0
    p_tokens = normalize_answer(prediction).split()
    for a in answers:
        a_tokens = normalize_answer(a).split()
        common = Counter(p_tokens) & Counter(a_tokens)
        same = sum(common.values())
        if not p_tokens or not a_tokens:
            best = max(best, float(p_tokens == a_tokens))
            continue
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(a_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def answer_in_text(text: str, answers: list[str] | tuple[str, ...]) -> bool:
    """Whether any normalised gold answer occurs in the normalised text (the 'gold string contained' rule)."""
    t = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(a)} " in t for a in answers if normalize_answer(a))


def substring_match(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Self-RAG's short-form metric "match" (Asai et al., 2024; PopQA / TriviaQA): 1.0 when any gold answer, as
    written, is a substring of the prediction. Unlike answer_in_text nothing is normalised (case and punctuation
    count) and no word boundary is required, so "six" matches "sixty"; it is kept as the paper scores, for
    comparison with its tables."""
    return float(any(a and a in prediction for a in answers))
