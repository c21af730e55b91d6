"""A Haystack component: certrag's retrieval (embed -> HNSW -> rerank -> select -> certify) as a retriever."""

from __future__ import annotations

from haystack import Document, component

from certrag.integrations import evidence, kept


@component
class CertragRetriever:
    """Outputs the selected chunks (the trusted ones with certify=True when the calibration holds) as Documents
    whose meta carry certrag's scores and certification; score is the fused rerank logit (or the cosine)."""

    def __init__(self, engine, candidates: int | None = None, certify: bool = False,
                 include_unselected: bool = False) -> None:
        self.engine = engine
        self.candidates = candidates
        self.certify = certify
        self.include_unselected = include_unselected

    @component.output_types(documents=list[Document])
    def run(self, query: str, candidates: int | None = None) -> dict:
        r = self.engine.retrieve(query, candidates=candidates or self.candidates)
        cert = self.engine.certify(r) if self.certify else None
        meta = evidence(r, cert)
        docs = []
        for i in kept(r, cert, self.include_unselected):
            score = meta[i]["rerank_score"] if meta[i]["rerank_score"] is not None else meta[i]["dense_score"]
            docs.append(Document(id=f"certrag-{meta[i]['chunk_id']}", content=r.texts[i], meta=meta[i], score=score))
        return {"documents": docs}
