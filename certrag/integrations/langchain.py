"""A LangChain retriever over a certrag Engine: embed -> HNSW -> rerank -> select (-> certify).

    retriever = CertragRetriever(engine=engine, k=4, filter={"lang": "en"})
    docs = retriever.invoke("who wrote hamlet")            # or .invoke(q, k=3, filter={...}), await .ainvoke(q)

Each Document's id is its source document's id, its metadata that document's own metadata with certrag's evidence
under "certrag" (chunk id, rank, scores, selected, trusted)."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from certrag.integrations import EVIDENCE_KEY, check_k, retrieve


class CertragRetriever(BaseRetriever):
    """engine: an open certrag Engine. k: exactly the k best chunks (default: certrag's selector decides how many);
    filter: document metadata that must match ({key: value or [values]}); both can also be given per call. Returns
    the selected chunks (or the trusted ones when certify=True and the calibration holds)."""

    engine: Any
    candidates: int | None = None
    k: int | None = None
    filter: dict | None = None
    certify: bool = False
    include_unselected: bool = False

    def _documents(self, query: str, k: int | None, filter: dict | None) -> list[Document]:
        rows = retrieve(self.engine, query, candidates=self.candidates,
                        k=check_k(k if k is not None else self.k), where=filter if filter is not None else self.filter,
                        certify=self.certify, include_unselected=self.include_unselected)
        return [Document(id=row["doc_id"], page_content=row["text"],
                         metadata={**row["metadata"], EVIDENCE_KEY: row["evidence"]}) for row in rows]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, filter: dict | None = None) -> list[Document]:
        return self._documents(query, k, filter)

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None, filter: dict | None = None) -> list[Document]:
        import asyncio

        return await asyncio.to_thread(self._documents, query, k, filter)
