"""LlamaIndex: a retriever over a certrag Engine, and a node postprocessor that brings certrag's reranking,
SAGE's gradient selection and conformal certification to any other retriever's nodes.

    nodes = CertragRetriever(engine, similarity_top_k=4).retrieve("who wrote hamlet")

A node's id is "<document id>#<chunk id>", its ref_doc_id the source document's id, its metadata that document's
own metadata with certrag's evidence under "certrag", which is kept out of what reaches the LLM and the embedder
(excluded_llm_metadata_keys / excluded_embed_metadata_keys); its score is the fused rerank logit (the cosine when no
reranker ran)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeRelationship, NodeWithScore, QueryBundle, RelatedNodeInfo, TextNode

from certrag.integrations import EVIDENCE_KEY, check_k, retrieve


def where_of(filters) -> dict | None:
    """LlamaIndex MetadataFilters as certrag's metadata filter: EQ and IN filters under AND; anything else is
    refused with ValueError (never silently ignored)."""
    if filters is None:
        return None
    from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilters

    if not isinstance(filters, MetadataFilters) or filters.condition not in (None, FilterCondition.AND):
        raise ValueError(f"filters: certrag supports MetadataFilters of EQ / IN filters under AND; got {filters!r}")
    where = {}
    for f in filters.filters:
        if isinstance(f, MetadataFilters) or f.operator not in (FilterOperator.EQ, FilterOperator.IN):
            raise ValueError(f"filters: certrag supports EQ and IN filters; got {f!r}")
        where[f.key] = f.value
    return where


def _hide_evidence(node: TextNode) -> None:
    for keys in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        if EVIDENCE_KEY not in keys:
            keys.append(EVIDENCE_KEY)


class CertragRetriever(BaseRetriever):
    """Nodes for the selected chunks (trusted ones with certify=True when the calibration holds). similarity_top_k:
    exactly that many best chunks (default: certrag's selector decides how many); filters: MetadataFilters."""

    def __init__(self, engine, *, candidates: int | None = None, similarity_top_k: int | None = None,
                 filters=None, certify: bool = False, include_unselected: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.candidates = candidates
        self.similarity_top_k = check_k(similarity_top_k, "similarity_top_k")
        self.filters = filters
        self.certify = certify
        self.include_unselected = include_unselected
        where_of(filters)  # refused here, not at the first query

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        rows = retrieve(self.engine, query_bundle.query_str, candidates=self.candidates, k=self.similarity_top_k,
                        where=where_of(self.filters), certify=self.certify,
                        include_unselected=self.include_unselected)
        out = []
        for row in rows:
            node = TextNode(text=row["text"], id_=f"{row['doc_id']}#{row['chunk_id']}",
                            metadata={**row["metadata"], EVIDENCE_KEY: row["evidence"]},
                            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=row["doc_id"])})
            _hide_evidence(node)
            out.append(NodeWithScore(node=node, score=row["score"]))
        return out

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class CertragPostprocessor(BaseNodePostprocessor):
    """Reranks another retriever's nodes with certrag's cross-encoder (fused with the embedder's cosine, as the
    engine does), cuts them with the engine's selector (SAGE's gradient rule by default), and returns the kept nodes
    best first, scored, with certrag's evidence under "certrag" in their metadata (kept from the LLM)."""

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
            node.metadata[EVIDENCE_KEY] = {"rank": rank + 1, "dense_score": float(dense[i]),
                                           "rerank_score": float(scores[i]) if kind == "logit" else None,
                                           "selected": True}
            _hide_evidence(node)
            out.append(NodeWithScore(node=node, score=float(scores[i])))
        return out
