"""LlamaIndex: a retriever over a certrag Engine, and a node postprocessor that brings certrag's reranking,
SAGE's gradient selection and conformal certification to any other retriever's nodes."""

from __future__ import annotations

from typing import Any

import numpy as np
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from certrag.integrations import evidence, kept


class CertragRetriever(BaseRetriever):
    """Nodes for the selected chunks (trusted ones with certify=True when the calibration holds); the score is the
    fused rerank logit (the cosine when no reranker ran), the metadata carry certrag's evidence."""

    def __init__(self, engine, *, candidates: int | None = None, certify: bool = False,
                 include_unselected: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.candidates = candidates
        self.certify = certify
        self.include_unselected = include_unselected

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        r = self.engine.retrieve(query_bundle.query_str, candidates=self.candidates)
        cert = self.engine.certify(r) if self.certify else None
        meta = evidence(r, cert)
        out = []
        for i in kept(r, cert, self.include_unselected):
            score = meta[i]["rerank_score"] if meta[i]["rerank_score"] is not None else meta[i]["dense_score"]
            node = TextNode(text=r.texts[i], id_=f"certrag-{meta[i]['chunk_id']}", metadata=meta[i])
            out.append(NodeWithScore(node=node, score=score))
        return out


class CertragPostprocessor(BaseNodePostprocessor):
    """Reranks another retriever's nodes with certrag's cross-encoder (fused with the embedder's cosine, as the
    engine does), cuts them with the engine's selector (SAGE's gradient rule by default), and returns the kept nodes
    best first with certrag's scores in their metadata."""

    engine: Any = Field(description="an open certrag Engine (its embedder, reranker and selection config)")

    @classmethod
    def class_name(cls) -> str:
        return "CertragPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        from certrag.select import cut

        if query_bundle is None:
            raise ValueError("CertragPostprocessor needs the query (query_bundle)")
        if not nodes:
            return []
        texts = [n.node.get_content() for n in nodes]
        vectors = self.engine.embedder.embed([query_bundle.query_str] + texts)
        dense = (vectors[1:] @ vectors[0]).astype(np.float32)
        reranker = self.engine.reranker
        if reranker is not None:
            scores, kind = reranker.score(query_bundle.query_str, texts, dense), "logit"
        else:
            scores, kind = dense, "cosine"
        order = np.argsort(-scores, kind="stable")
        n = cut(self.engine.config.selection.make(), scores[order], kind)
        out = []
        for rank, i in enumerate(order[:n]):
            node = nodes[i].node
            node.metadata.update({"rank": rank + 1, "dense_score": float(dense[i]),
                                  "rerank_score": float(scores[i]) if kind == "logit" else None, "selected": True})
            out.append(NodeWithScore(node=node, score=float(scores[i])))
        return out
