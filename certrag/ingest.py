"""Indexing's parallel half: documents segmented and embedded, in groups, by whoever has the models -- the engine
itself, or the workers of a Ray Data job (certrag.scale.indexing). The other half, giving chunks their ids and
writing the store, stays with the one writer (Engine), so a store built either way is the same store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from certrag.documents import Document

GROUP = 64  # documents per group: the segmenter embeds a group's sentences in one batched call


@dataclass(frozen=True)
class Prepared:
    """One document, segmented and embedded. chunks: {"start", "end", "n_tokens", "text"} in document order;
    vectors: float32 (len(chunks), dim), row i embedding chunks[i]. An empty document has no chunks."""

    doc: Document
    chunks: list[dict]
    vectors: np.ndarray


def prepare(docs: Sequence[Document], chunker, embedder) -> list[Prepared]:
    """Segments and embeds one group of documents. The group's chunks are embedded right after its sentences, while
    the embedder still remembers them (a chunk that is one sentence is not embedded twice). A chunk's vector does
    not depend on which group it came in (the encoders' batches are padded to a fixed grid), so any grouping --
    this process's groups of GROUP, or a Ray worker's batches -- gives the same vectors."""
    live = [d for d in docs if d.text.strip()]
    split_many = getattr(chunker, "split_many", None)
    pieces = split_many([d.text for d in live]) if split_many else [chunker.split(d.text) for d in live]
    texts = [c.text for chunks in pieces for c in chunks]
    vectors = embedder.embed(texts) if texts else np.zeros((0, embedder.dim), np.float32)
    out, at, by_id = [], 0, {}
    for doc, chunks in zip(live, pieces):
        rows = [{"start": c.start, "end": c.end, "n_tokens": c.n_tokens, "text": c.text} for c in chunks]
        by_id[doc.id] = Prepared(doc, rows, np.asarray(vectors[at:at + len(rows)], dtype=np.float32))
        at += len(rows)
    for doc in docs:
        out.append(by_id.get(doc.id) or Prepared(doc, [], np.zeros((0, embedder.dim), np.float32)))
    return out
