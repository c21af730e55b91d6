"""certrag inside the frameworks its users already have, each an optional extra:

- LangChain: ``certrag.integrations.langchain.CertragRetriever`` (``pip install 'certrag[langchain]'``)
- LlamaIndex: ``certrag.integrations.llama_index.CertragRetriever`` and ``CertragPostprocessor`` (certrag's rerank,
  gradient selection and certification over another retriever's nodes) (``pip install 'certrag[llama-index]'``)
- Haystack: ``certrag.integrations.haystack.CertragRetriever``, a component (``pip install 'certrag[haystack]'``)

Each behaves as its framework's own retrievers do: the document's id and the user's metadata come back as they were
indexed; k / top_k / similarity_top_k and metadata filters are honoured; the score sits in the framework's score
field where it has one. certrag's evidence -- chunk id, rank, dense and rerank scores, whether the selector kept the
chunk, and with certify=True whether the conformal calibration trusts it -- travels under one metadata key,
EVIDENCE_KEY ("certrag"), which the LlamaIndex nodes keep out of what reaches the LLM and the embedder.
"""

from __future__ import annotations

EVIDENCE_KEY = "certrag"


def evidence(retrieval, certification=None) -> list[dict]:
    """Per candidate of a certrag Retrieval, the evidence every adapter attaches under EVIDENCE_KEY."""
    import math

    rows = []
    for i, (cid, did, dense, rr) in enumerate(zip(retrieval.chunk_ids, retrieval.doc_ids, retrieval.dense_scores,
                                                  retrieval.rerank_scores)):
        row = {"chunk_id": int(cid), "doc_id": did, "rank": i + 1, "dense_score": float(dense),
               "rerank_score": None if math.isnan(rr) else float(rr), "selected": i < retrieval.selected}
        if certification is not None:
            row["trusted"] = bool(certification.trusted[i])
            row["certification_applied"] = bool(certification.applied)
            row["certification_reason"] = certification.reason
        rows.append(row)
    return rows


def kept(retrieval, certification=None, include_unselected: bool = False) -> list[int]:
    """Indices of the candidates an adapter returns: the selected cut, or with a certification that applies, the
    trusted candidates; every candidate with include_unselected."""
    if include_unselected:
        return list(range(len(retrieval.chunk_ids)))
    if certification is not None and certification.applied:
        return [i for i, t in enumerate(certification.trusted) if t]
    return list(range(retrieval.selected))


def check_k(k, argument: str = "k") -> int | None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"{argument} must be a positive integer; got {k!r}")
    return k


def retrieve(engine, query: str, *, candidates: int | None, k: int | None, where: dict | None,
             certify: bool, include_unselected: bool) -> list[dict]:
    """What every adapter returns, framework-free: per kept chunk its text, its document's id and own metadata, the
    score (the fused rerank logit, or the cosine when no reranker ran) and certrag's evidence. k: exactly the k best
    chunks (top-k selection over at least k candidates) instead of the configured selector's cut; where: a metadata
    filter (Engine.retrieve's)."""
    from certrag.select import TopKSelector

    selector = TopKSelector(k=k) if k is not None else None
    if k is not None:
        candidates = max(candidates or engine.config.retrieval.candidates, k)
    r = engine.retrieve(query, candidates=candidates, selector=selector, where=where)
    cert = engine.certify(r) if certify else None
    meta = evidence(r, cert)
    rows = []
    for i in kept(r, cert, include_unselected):
        score = meta[i]["rerank_score"] if meta[i]["rerank_score"] is not None else meta[i]["dense_score"]
        try:
            own = engine.metadata(r.doc_ids[i])
        except KeyError:  # removed by a writer since this retrieval's view
            own = {}
        rows.append({"text": r.texts[i], "doc_id": r.doc_ids[i], "chunk_id": meta[i]["chunk_id"],
                     "metadata": own, "score": score, "evidence": {**meta[i], "score": score}})
    return rows
