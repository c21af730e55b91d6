"""certrag inside the frameworks its users already have, each an optional extra:

- LangChain: ``certrag.integrations.langchain.CertragRetriever`` (``pip install 'certrag[langchain]'``)
- LlamaIndex: ``certrag.integrations.llama_index.CertragRetriever`` and ``CertragPostprocessor`` (certrag's rerank,
  gradient selection and certification over another retriever's nodes) (``pip install 'certrag[llama-index]'``)
- Haystack: ``certrag.integrations.haystack.CertragRetriever``, a component (``pip install 'certrag[haystack]'``)

Each returns certrag's evidence in the framework's metadata: chunk and document ids, dense and rerank scores, rank,
whether the selector kept the chunk, and with certify=True whether the conformal calibration trusts it.
"""


def evidence(retrieval, certification=None) -> list[dict]:
    """Per candidate of a certrag Retrieval, the metadata every adapter attaches."""
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
