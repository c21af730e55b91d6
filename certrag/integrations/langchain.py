"""A LangChain retriever over a certrag Engine: embed -> HNSW -> rerank -> select (-> certify)."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from certrag.integrations import evidence, kept


class CertragRetriever(BaseRetriever):
    """engine: an open certrag Engine. Returns the selected chunks (or the trusted ones when certify=True and the
    calibration holds) as Documents whose metadata carry certrag's scores and certification."""

    engine: Any
    candidates: int | None = None
    certify: bool = False
    include_unselected: bool = False

    def _documents(self, retrieval) -> list[Document]:
        cert = self.engine.certify(retrieval) if self.certify else None
        meta = evidence(retrieval, cert)
        return [Document(page_content=retrieval.texts[i], metadata=meta[i])
                for i in kept(retrieval, cert, self.include_unselected)]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self._documents(self.engine.retrieve(query, candidates=self.candidates))

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        return self._documents(await self.engine.aretrieve(query, candidates=self.candidates))
