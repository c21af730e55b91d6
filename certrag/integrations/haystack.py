"""A Haystack component: certrag's retrieval (embed -> HNSW -> rerank -> select -> certify) as a retriever.

    pipe.add_component("retriever", CertragRetriever(store="kb", top_k=4))
    pipe.run({"retriever": {"query": "who wrote hamlet", "filters": {"field": "meta.lang", "operator": "==",
                                                                      "value": "en"}}})

Each Document's id is "<document id>#<chunk id>" (unique, as Haystack's joiners expect), its meta the source
document's own metadata with the document's id as `source_id` (Haystack's splitters' convention) and certrag's
evidence under "certrag"; its score is the fused rerank logit (the cosine when no reranker ran). The component
serialises as its store's path and options (to_dict / from_dict), never as the Engine object; Haystack loads a
saved pipeline's components only from modules it is told to trust:
`Pipeline.loads(text, allowed_modules=["certrag.integrations.haystack"])`."""

from __future__ import annotations

from pathlib import Path

from haystack import Document, component, default_from_dict, default_to_dict

from certrag.integrations import EVIDENCE_KEY, check_k, retrieve


def where_of(filters: dict | None) -> dict | None:
    """Haystack's filter syntax as certrag's metadata filter: "==" and "in" on "meta.<key>" fields, alone or under
    one "AND"; anything else is refused with ValueError (never silently ignored)."""
    if not filters:
        return None
    conditions = filters["conditions"] if filters.get("operator") == "AND" and "conditions" in filters else [filters]
    where = {}
    for c in conditions:
        field, op = c.get("field", ""), c.get("operator")
        if not field.startswith("meta.") or op not in ("==", "in") or "conditions" in c:
            raise ValueError(f"filters: certrag supports '==' and 'in' on meta fields, alone or under AND; got {c!r}")
        where[field[5:]] = c["value"]
    return where


@component
class CertragRetriever:
    """engine: an open certrag Engine, or store: a store's path (opened read-only). top_k: exactly the top_k best
    chunks (default: certrag's selector decides how many); filters: Haystack's filter syntax ("==" / "in" on meta
    fields). Outputs the selected chunks (the trusted ones with certify=True when the calibration holds)."""

    def __init__(self, engine=None, *, store: str | None = None, candidates: int | None = None,
                 top_k: int | None = None, filters: dict | None = None, certify: bool = False,
                 include_unselected: bool = False) -> None:
        if engine is None and store is None:
            raise ValueError("give engine (an open certrag Engine) or store (a store's path)")
        if engine is None:
            from certrag.engine import Engine

            engine = Engine.open(store, read_only=True)
        self.engine = engine
        self.store = str(store if store is not None else engine.path)
        self.candidates, self.top_k, self.filters = candidates, check_k(top_k, "top_k"), filters
        self.certify, self.include_unselected = certify, include_unselected
        where_of(filters)  # a filter certrag cannot honour is refused here, not at the first query

    def to_dict(self) -> dict:
        return default_to_dict(self, store=str(Path(self.store).resolve()), candidates=self.candidates,
                               top_k=self.top_k, filters=self.filters, certify=self.certify,
                               include_unselected=self.include_unselected)

    @classmethod
    def from_dict(cls, data: dict) -> "CertragRetriever":
        return default_from_dict(cls, data)

    @component.output_types(documents=list[Document])
    def run(self, query: str, top_k: int | None = None, filters: dict | None = None) -> dict:
        rows = retrieve(self.engine, query, candidates=self.candidates,
                        k=check_k(top_k if top_k is not None else self.top_k, "top_k"),
                        where=where_of(filters if filters is not None else self.filters), certify=self.certify,
                        include_unselected=self.include_unselected)
        return {"documents": [Document(id=f"{row['doc_id']}#{row['chunk_id']}", content=row["text"],
                                       meta={**row["metadata"], "source_id": row["doc_id"],
                                             EVIDENCE_KEY: row["evidence"]}, score=row["score"])
                              for row in rows]}

    @component.output_types(documents=list[Document])
    async def run_async(self, query: str, top_k: int | None = None, filters: dict | None = None) -> dict:
        import asyncio

        return await asyncio.to_thread(self.run, query, top_k, filters)
