"""Text to paragraphs to sentences, keeping character offsets into the original text.

Paragraphs are runs of non-blank lines (a blank line, or a newline when ``newline_is_break`` is set, ends one). Inside
a paragraph, sentences come from blingfire's sentence breaker, a compiled finite-state model, chosen over pysbd for
speed at equal quality on Wikipedia leads (measured in benchmarks/bench_segmentation.py; the figures are in
benchmarks/RESULTS.md). Offsets are always mapped back onto the original string, so ``text[s.start:s.end] == s.text``
holds for every sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_NEWLINE = re.compile(r"\n")


@dataclass(frozen=True)
class Sentence:
    text: str
    start: int  # character offset into the original text
    end: int  # exclusive
    paragraph: int  # index of the paragraph that holds it


def paragraphs(text: str, *, newline_is_break: bool = False) -> list[tuple[int, int]]:
    """Character spans (start, end) of the paragraphs of text, whitespace trimmed, empty ones dropped."""
    pattern = _NEWLINE if newline_is_break else _BLANK_LINE
    spans, pos = [], 0
    for m in pattern.finditer(text):
        spans.append((pos, m.start()))
        pos = m.end()
    spans.append((pos, len(text)))
    out = []
    for s, e in spans:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            out.append((s, e))
    return out


def _blingfire_spans(paragraph: str) -> list[tuple[int, int]]:
    import blingfire

    # blingfire normalises whitespace inside sentences; its offsets refer to the input, which is what we need.
    _, offsets = blingfire.text_to_sentences_and_offsets(paragraph)
    return [(int(s), int(e)) for s, e in offsets]


def split_sentences(text: str, *, newline_is_break: bool = False) -> list[Sentence]:
    """Sentences of text, in order, with offsets into text and their paragraph index."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str; got {type(text).__name__}")
    out: list[Sentence] = []
    for p_index, (ps, pe) in enumerate(paragraphs(text, newline_is_break=newline_is_break)):
        para = text[ps:pe]
        spans = _blingfire_spans(para) or [(0, len(para))]
        for s, e in spans:
            s, e = max(0, s), min(len(para), e)
            while s < e and para[s].isspace():
                s += 1
            while e > s and para[e - 1].isspace():
                e -= 1
            if e > s:
                out.append(Sentence(text=para[s:e], start=ps + s, end=ps + e, paragraph=p_index))
    return out
