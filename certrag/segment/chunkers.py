"""Chunkers: SAGE's trained semantic segmenter and the baselines it is measured against, behind one interface.

Every chunker turns a text into a list of Chunk objects whose offsets index the original text
(``text[c.start:c.end] == c.text``), in order and without overlap; what lies between two chunks is whitespace only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from certrag.segment.sentences import Sentence, split_sentences


@dataclass(frozen=True)
class Chunk:
    text: str
    start: int  # character offset into the original text
    end: int  # exclusive
    n_tokens: int  # word-piece tokens of the embedder's tokenizer


class Chunker(Protocol):
    name: str

    def split(self, text: str) -> list[Chunk]: ...


@dataclass(frozen=True, kw_only=True)
class SegmenterConfig:
    """Settings of SAGE's semantic segmenter.

    window_tokens: l, the size of the coarse sentence-complete windows scored independently.
    threshold: split between two sentences where p(same chunk) < threshold; None (the default) takes the threshold
        saved in the head's card, chosen on its training documents (0.5 for a head without one).
    min_tokens / max_tokens: bounds every chunk respects (max_tokens >= 2 * min_tokens, so that any oversized run
        can be cut into pieces that respect both; only a whole text shorter than min_tokens yields a smaller chunk).
        Chunks end at sentence boundaries whenever the bounds allow; where they do not (a sentence longer than
        max_tokens, or a short sentence wedged between long ones), a cut falls at a word boundary inside a sentence.
    newline_is_break: treat every newline (not only blank lines) as a paragraph break when splitting sentences, as
        SAGE splits text into paragraphs on '\n' (the default); False keeps only blank lines as breaks.
    paragraph_breaks: a paragraph break (a blank line; any newline with newline_is_break) is a cut point whatever
        the head says, and the weakest joint when sizes are enforced: a chunk never spans two paragraphs unless one
        of them is shorter than min_tokens (a heading, a one-line paragraph), which then joins its neighbour.
    """

    window_tokens: int = 256
    threshold: float | None = None
    min_tokens: int = 24
    max_tokens: int = 256
    newline_is_break: bool = True
    paragraph_breaks: bool = True

    def __post_init__(self) -> None:
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be at least 1; got {self.window_tokens}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1]; got {self.threshold}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1; got {self.min_tokens}")
        if self.max_tokens < 2 * self.min_tokens:
            raise ValueError(f"max_tokens must be at least 2 * min_tokens = {2 * self.min_tokens}; "
                             f"got {self.max_tokens}")


# ------------------------------------------------------------------------------------------------ shared machinery

@dataclass
class _Units:
    """Sentences (or pieces of over-long sentences) with token counts."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    paragraph: list[int] = field(default_factory=list)


def _token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    enc = tokenizer.encode(text, add_special_tokens=False)
    return [(s, e) for s, e in enc.offsets]


def _units(text: str, sentences: list[Sentence], counts: np.ndarray, max_tokens: int, tokenizer) -> _Units:
    """Sentences as units, with any sentence longer than max_tokens cut at token boundaries into equal pieces."""
    u = _Units()
    for s, n in zip(sentences, counts):
        n = int(n)
        if n <= max_tokens:
            u.spans.append((s.start, s.end))
            u.tokens.append(n)
            u.paragraph.append(s.paragraph)
            continue
        offs = _token_spans(tokenizer, s.text)
        pieces = -(-len(offs) // max_tokens)
        bounds = np.linspace(0, len(offs), pieces + 1).round().astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            start = s.start + offs[a][0]
            end = s.start + (offs[b][0] if b < len(offs) else len(s.text))
            while end > start and text[end - 1].isspace():
                end -= 1
            u.spans.append((start, end))
            u.tokens.append(int(b - a))
            u.paragraph.append(s.paragraph)
    return u


def _enforce_sizes(cuts: list[int], tokens: Sequence[int], strength: np.ndarray, min_tokens: int,
                   max_tokens: int) -> list[int]:
    """Adjusts segment starts so that every segment holds min..max tokens.

    cuts: sorted unit indices where segments start (0 first). strength[i]: how strongly units i and i+1 belong
    together (higher = keep together). Small segments merge into the neighbour they belong with more strongly;
    oversized ones split at their weakest joint that leaves both sides at least min_tokens, recursively. Units are
    at most max_tokens each, and max_tokens >= 2 * min_tokens, so a valid split always exists unless a segment
    has a unit that alone exceeds what remains; then the split that best balances the two sides is taken.
    """
    csum = np.concatenate([[0], np.cumsum(tokens)])
    total = int(csum[-1])
    m = len(tokens)

    def size(a, b):
        return int(csum[b] - csum[a])

    segs = [(a, b) for a, b in zip(cuts, cuts[1:] + [m])]
    merged = True
    while merged and len(segs) > 1:
        merged = False
        for idx, (a, b) in enumerate(segs):
            if size(a, b) >= min_tokens:
                continue
            left = strength[a - 1] if idx > 0 else -np.inf
            right = strength[b - 1] if idx + 1 < len(segs) else -np.inf
            j = idx - 1 if left >= right else idx + 1
            lo, hi = min(idx, j), max(idx, j)
            segs[lo:hi + 1] = [(segs[lo][0], segs[hi][1])]
            merged = True
            break

    out: list[tuple[int, int]] = []

    def split(a, b):
        if size(a, b) <= max_tokens or b - a < 2:
            out.append((a, b))
            return
        joints = list(range(a + 1, b))
        valid = [j for j in joints if size(a, j) >= min_tokens and size(j, b) >= min_tokens]
        if valid:
            j = min(valid, key=lambda j: (strength[j - 1], abs(size(a, j) - size(j, b))))
        else:
            j = min(joints, key=lambda j: abs(size(a, j) - size(j, b)))
        split(a, j)
        split(j, b)

    for a, b in segs:
        split(a, b)
    if total < min_tokens:
        return [0]
    return [a for a, _ in out]


def _text_units(text: str, embedder, newline_is_break: bool, max_tokens: int) -> _Units:
    """Sentences of text as units with token counts (over-long sentences cut to max_tokens)."""
    sentences = split_sentences(text, newline_is_break=newline_is_break)
    if not sentences:
        return _Units()
    counts = embedder.count_tokens([s.text for s in sentences])
    return _units(text, sentences, counts, max_tokens, embedder.counter)


_SENTENCE_END = (".", "!", "?", '."', '?"', '!"')


def _paragraph_joints(text: str, units: _Units) -> tuple[list[int], list[int]]:
    """(cuts, headings): joints j (between units j and j + 1) where a paragraph ends. A heading or lead-in (a
    one-unit paragraph with no sentence-final stop: "## Warranty", "Features:") belongs to the paragraph after it,
    so its joint is in headings, not in cuts."""
    para = np.asarray(units.paragraph)
    cuts, headings = [], []
    for j in np.flatnonzero(para[1:] != para[:-1]):
        a, b = units.spans[j]
        heading = (j == 0 or para[j - 1] != para[j]) and not text[a:b].rstrip().endswith(_SENTENCE_END)
        (headings if heading else cuts).append(int(j))
    return cuts, headings


def _paragraph_groups(text: str, units: _Units, paragraph_breaks: bool,
                      cuts: list[int] | None = None) -> list[tuple[int, int]]:
    """Runs of units [a, b) between paragraph cuts (the whole text as one run without paragraph_breaks). cuts: the
    joints _paragraph_joints found, when the caller has them already."""
    n = len(units.spans)
    if not paragraph_breaks or n == 0:
        return [(0, n)] if n else []
    if cuts is None:
        cuts = _paragraph_joints(text, units)[0]
    starts = [0] + [j + 1 for j in cuts]
    return list(zip(starts, starts[1:] + [n]))


def _make_chunk(text: str, start: int, end: int, counter) -> Chunk:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return Chunk(text=text[start:end], start=start, end=end,
                 n_tokens=len(counter.encode(text[start:end], add_special_tokens=False).ids))


def _repair_small(text: str, chunks: list[Chunk], min_tokens: int, max_tokens: int, counter) -> list[Chunk]:
    """Last resort for a chunk under min_tokens that no sentence boundary could avoid: merge it with its smaller
    neighbour; if that exceeds max_tokens, cut the merged span in two at the word boundary nearest its token
    midpoint. Both halves then hold more than max_tokens / 2 >= min_tokens tokens."""
    chunks = list(chunks)
    i = 0
    while len(chunks) > 1 and i < len(chunks):
        if chunks[i].n_tokens >= min_tokens:
            i += 1
            continue
        if i == 0:
            j = 1
        elif i == len(chunks) - 1:
            j = i - 1
        else:
            j = i - 1 if chunks[i - 1].n_tokens <= chunks[i + 1].n_tokens else i + 1
        lo, hi = min(i, j), max(i, j)
        start, end = chunks[lo].start, chunks[hi].end
        merged = _make_chunk(text, start, end, counter)
        if merged.n_tokens <= max_tokens:
            chunks[lo:hi + 1] = [merged]
            i = lo
            continue
        enc = counter.encode(text[start:end], add_special_tokens=False)
        half = len(enc.ids) // 2
        word_starts = [t for t, (a, _) in enumerate(enc.offsets) if t > 0 and a > 0 and text[start + a - 1].isspace()]
        cut_token = min(word_starts, key=lambda t: abs(t - half)) if word_starts else half
        cut = start + enc.offsets[cut_token][0]
        first, second = _make_chunk(text, start, cut, counter), _make_chunk(text, cut, end, counter)
        if not (min_tokens <= first.n_tokens <= max_tokens and min_tokens <= second.n_tokens <= max_tokens):
            cut = start + enc.offsets[half][0]
            first, second = _make_chunk(text, start, cut, counter), _make_chunk(text, cut, end, counter)
        chunks[lo:hi + 1] = [first, second]
        i = lo
    return chunks


def _chunks(text: str, units: _Units, starts: list[int]) -> list[Chunk]:
    chunks = []
    ends = starts[1:] + [len(units.spans)]
    for a, b in zip(starts, ends):
        if b <= a:
            continue
        s, e = units.spans[a][0], units.spans[b - 1][1]
        chunks.append(Chunk(text=text[s:e], start=s, end=e, n_tokens=int(sum(units.tokens[a:b]))))
    return chunks


def _windows(tokens: Sequence[int], window_tokens: int) -> list[int]:
    """Starts of coarse sentence-complete windows of about window_tokens tokens."""
    if not tokens:
        return []
    starts, acc = [0], 0
    for i, t in enumerate(tokens):
        if acc > 0 and acc + t > window_tokens:
            starts.append(i)
            acc = 0
        acc += t
    return starts


# --------------------------------------------------------------------------------------------------------- SAGE

class Segmenter:
    """SAGE's semantic segmenter (Wang et al., 2025, "SAGE: A Framework of Precise Retrieval for RAG", section 3.1).

    Text -> paragraphs -> sentences -> coarse windows of about l tokens -> p(same chunk) for every adjacent pair
    inside a window (trained head on sentence embeddings, native fused scorer) -> split where p < threshold ->
    min/max token bounds enforced.
    """

    name = "sage"

    def __init__(self, head=None, embedder=None, config: SegmenterConfig | None = None) -> None:
        from certrag.embed import Embedder
        from certrag.segment.head import SegmenterHead

        self.head = head if head is not None else SegmenterHead.default()
        own = self.head.embedder_dir
        if embedder is None:
            embedder = self.head.own_embedder() or Embedder.default()
        elif own is not None and Path(embedder.model_dir).resolve() != own.resolve():
            raise ValueError(f"embedder: this head was trained with the fine-tuned encoder at {own}; leave embedder "
                             f"out to load it (got the one at {embedder.model_dir})")
        self.embedder = embedder
        self.config = config or SegmenterConfig()
        self.threshold = (self.config.threshold if self.config.threshold is not None
                          else float(self.head.card.get("threshold", 0.5)))
        if self.head.dim != self.embedder.dim:
            raise ValueError(f"the head expects {self.head.dim}-d embeddings but the embedder gives "
                             f"{self.embedder.dim}-d ones")

    @classmethod
    def default(cls, config: SegmenterConfig | None = None) -> "Segmenter":
        """The bundled embedder with the head trained by certrag and shipped in the package."""
        return cls(config=config)

    def pair_probabilities(self, texts: list[str]) -> np.ndarray:
        """p(same chunk) for each adjacent pair of the given sentences: (n - 1,)."""
        if len(texts) < 2:
            return np.zeros(0, dtype=np.float32)
        return self.head.score_adjacent(self.embedder.embed(texts))

    def split(self, text: str) -> list[Chunk]:
        return self.split_many([text])[0]

    def split_many(self, texts: Sequence[str]) -> list[list[Chunk]]:
        """split() of each text, with the sentences of all of them embedded in one batched call (each distinct
        sentence once)."""
        cfg = self.config
        units = [_text_units(text, self.embedder, cfg.newline_is_break, cfg.max_tokens) for text in texts]
        sentences = [[text[s:e] for s, e in u.spans] for text, u in zip(texts, units)]
        flat = [t for sents in sentences if len(sents) > 1 for t in sents]
        vectors = self.embedder.embed(flat) if flat else np.zeros((0, self.embedder.dim), np.float32)
        out, at = [], 0
        for text, u, sents in zip(texts, units, sentences):
            if not u.spans:
                out.append([])
                continue
            if len(sents) > 1:
                probs = self.head.score_adjacent(vectors[at:at + len(sents)])
                at += len(sents)
            else:
                probs = np.zeros(0, dtype=np.float32)
            out.append(self._finish(text, u, probs))
        return out

    def _finish(self, text: str, units: _Units, probs: np.ndarray) -> list[Chunk]:
        cfg = self.config
        strength = probs.astype(np.float64)
        # coarse windows are packed inside paragraphs (SAGE: text -> paragraphs -> windows), so a window's edge never
        # falls inside a paragraph that fits in one window
        paragraph_cuts, headings = _paragraph_joints(text, units) if cfg.paragraph_breaks else ([], [])
        window_starts = {a + w for a, b in _paragraph_groups(text, units, cfg.paragraph_breaks, paragraph_cuts)
                         for w in _windows(units.tokens[a:b], cfg.window_tokens)}
        cuts = [0] + [i + 1 for i, p in enumerate(probs) if p < self.threshold or (i + 1) in window_starts]
        if cfg.paragraph_breaks:
            for j in paragraph_cuts:
                strength[j] = -1.0  # weaker than any probability: merged across last, split at first
                cuts.append(j + 1)
            for j in headings:  # a heading stays with what it heads: no cut, stronger than any probability
                strength[j] = 2.0
                cuts = [c for c in cuts if c != j + 1]
        cuts = sorted(set(cuts))
        starts = _enforce_sizes(cuts, units.tokens, strength, cfg.min_tokens, cfg.max_tokens)
        chunks = _chunks(text, units, starts)
        if any(c.n_tokens < cfg.min_tokens for c in chunks) and len(chunks) > 1:
            chunks = _repair_small(text, chunks, cfg.min_tokens, cfg.max_tokens, self.embedder.counter)
        return chunks


# ----------------------------------------------------------------------------------------------------- baselines

class FixedSizeChunker:
    """Fixed-size chunks of `tokens` word-pieces, cut wherever the count falls (LangChain's TokenTextSplitter with
    no overlap). With paragraph_breaks, every paragraph (headings joined to what they head, as SAGE does) is cut on
    its own, so no chunk spans a paragraph break."""

    name = "fixed"

    def __init__(self, tokens: int = 128, embedder=None, *, paragraph_breaks: bool = False,
                 newline_is_break: bool = True) -> None:
        from certrag.embed import Embedder

        if tokens < 1:
            raise ValueError(f"tokens must be at least 1; got {tokens}")
        self.tokens = tokens
        self.paragraph_breaks = paragraph_breaks
        self.newline_is_break = newline_is_break
        self.embedder = embedder if embedder is not None else Embedder.default()

    def split(self, text: str) -> list[Chunk]:
        if self.paragraph_breaks:
            units = _text_units(text, self.embedder, self.newline_is_break, 10**9)
            spans = [(units.spans[a][0], units.spans[b - 1][1])
                     for a, b in _paragraph_groups(text, units, True)]
        else:
            spans = [(0, len(text))]
        chunks = []
        for start, end in spans:
            offs = [(start + a, start + b) for a, b in _token_spans(self.embedder.counter, text[start:end])]
            for a in range(0, len(offs), self.tokens):
                b = min(len(offs), a + self.tokens)
                s, e = offs[a][0], offs[b - 1][1]
                chunks.append(Chunk(text=text[s:e], start=s, end=e, n_tokens=b - a))
        return chunks


class SentenceFixedChunker:
    """Whole sentences packed greedily up to `tokens` word-pieces (LlamaIndex's SentenceSplitter, no overlap). With
    paragraph_breaks, packing starts again at every paragraph (headings joined to what they head)."""

    name = "fixed_sentence"

    def __init__(self, tokens: int = 128, embedder=None, newline_is_break: bool = False, *,
                 paragraph_breaks: bool = False) -> None:
        from certrag.embed import Embedder

        if tokens < 1:
            raise ValueError(f"tokens must be at least 1; got {tokens}")
        self.tokens = tokens
        self.newline_is_break = newline_is_break
        self.paragraph_breaks = paragraph_breaks
        self.embedder = embedder if embedder is not None else Embedder.default()

    def split(self, text: str) -> list[Chunk]:
        units = _text_units(text, self.embedder, self.newline_is_break, self.tokens)
        starts = []
        for a, b in _paragraph_groups(text, units, self.paragraph_breaks):
            starts += [a + w for w in _windows(units.tokens[a:b], self.tokens)]
        return _chunks(text, units, starts)


class PercentileSemanticChunker:
    """Embedding-distance breakpoints (LangChain's SemanticChunker, breakpoint_threshold_type="percentile", and
    LlamaIndex's SemanticSplitterNodeParser): each sentence is embedded with `buffer` neighbours on each side, and
    the text splits where the cosine distance between consecutive sentences exceeds the given percentile. With
    paragraph_breaks, every paragraph break (not before a heading) is a breakpoint too."""

    name = "semantic_percentile"

    def __init__(self, percentile: float = 95.0, buffer: int = 1, embedder=None,
                 newline_is_break: bool = False, *, paragraph_breaks: bool = False) -> None:
        from certrag.embed import Embedder

        if not 0.0 <= percentile <= 100.0:
            raise ValueError(f"percentile must be in [0, 100]; got {percentile}")
        if buffer < 0:
            raise ValueError(f"buffer must be >= 0; got {buffer}")
        self.percentile = percentile
        self.buffer = buffer
        self.newline_is_break = newline_is_break
        self.paragraph_breaks = paragraph_breaks
        self.embedder = embedder if embedder is not None else Embedder.default()

    def split(self, text: str) -> list[Chunk]:
        units = _text_units(text, self.embedder, self.newline_is_break, 10**9)
        n = len(units.spans)
        if n == 0:
            return []
        if n < 2:
            return _chunks(text, units, [0])
        pieces = [text[s:e] for s, e in units.spans]
        combined = [" ".join(pieces[max(0, i - self.buffer): i + self.buffer + 1]) for i in range(n)]
        emb = self.embedder.embed(combined)
        distance = 1.0 - np.sum(emb[:-1] * emb[1:], axis=1)
        threshold = np.percentile(distance, self.percentile)
        starts = {0} | {i + 1 for i, d in enumerate(distance) if d > threshold}
        starts |= {a for a, _ in _paragraph_groups(text, units, self.paragraph_breaks)}
        return _chunks(text, units, sorted(starts))
