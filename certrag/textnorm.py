"""Answer text as DPR compares it (Karpukhin et al., 2020): lower-cased, stripped of punctuation and of the articles
a / an / the, whitespace-normalised. Used by the QA metrics (certrag.eval.metrics) and by the answer's support
signal (certrag.certify.factuality), which must read answers the way the label does."""

from __future__ import annotations

import re
import string
import unicodedata

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = unicodedata.normalize("NFD", text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
