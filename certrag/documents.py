"""Documents in: strings, files, folders of text/markdown, JSONL with id, text and metadata, and Parquet with the
same columns (metadata a struct or a JSON string; needs pyarrow)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
DOCUMENT_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: dict = field(default_factory=dict)


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def document_from_row(row: object, where: str) -> Document:
    """A Document from one JSONL line's object or one Parquet row: 'id' and a string 'text' required, 'metadata' an
    object (or, from Parquet, a JSON string of one) or absent. where names the row in errors."""
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise ValueError(f"{where}: each row needs a string field 'text'")
    doc_id = row.get("id")
    if doc_id is None:
        raise ValueError(f"{where}: each row needs an 'id'")
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: 'metadata' is a string that is not JSON") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be an object")
    return Document(id=str(doc_id), text=row["text"], metadata=metadata)


def document_from_line(line: str, where: str) -> Document | None:
    """A Document from one JSONL line (None for a blank line)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    return document_from_row(row, where)


def _from_jsonl(path: Path) -> list[Document]:
    docs = []
    for line_no, line in enumerate(_read_text(path).splitlines(), 1):
        doc = document_from_line(line, f"{path}:{line_no}")
        if doc is not None:
            docs.append(doc)
    return docs


def _from_parquet(path: Path) -> list[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    rows = pq.read_table(path).to_pylist()
    return [document_from_row(_without_nulls(row), f"{path}: row {i}") for i, row in enumerate(rows)]


def _without_nulls(row: dict) -> dict:
    """A Parquet row with the keys a struct column fills with null for documents that lack them dropped from its
    metadata (Arrow gives every row of a struct column every field)."""
    meta = row.get("metadata")
    if isinstance(meta, dict):
        row = {**row, "metadata": {k: v for k, v in meta.items() if v is not None}}
    return row


def read_path(path: Path, root: Path | None = None) -> list[Document]:
    """The documents of one file (JSONL, Parquet, text) or of every document file in a folder, as load_documents
    reads them; root: the folder a text file's id is relative to (certrag.scale.indexing reads file by file)."""
    if path.is_dir():
        files = document_files(path)
        if not files:
            raise ValueError(f"{path} holds no documents (files ending in {', '.join(DOCUMENT_SUFFIXES)})")
        out = []
        for f in files:
            out += read_path(f, path)
        return out
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    if path.suffix.lower() == ".jsonl":
        return _from_jsonl(path)
    if path.suffix.lower() == ".parquet":
        return _from_parquet(path)
    name = str(path.relative_to(root)) if root is not None else path.name
    return [Document(id=name, text=_read_text(path), metadata={"source": str(path)})]


def document_files(folder: Path) -> list[Path]:
    """The files of a folder that hold documents, in the order they are indexed (sorted paths)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in DOCUMENT_SUFFIXES)


def existing_path(item: object) -> Path | None:
    """The file or folder that item names, when it is an os.PathLike or a one-line string naming something that
    exists (the rule load_documents reads paths by); None otherwise."""
    if isinstance(item, os.PathLike):
        return Path(item)
    if isinstance(item, str) and len(item) < 4096 and "\n" not in item and Path(item).expanduser().exists():
        return Path(item).expanduser()
    return None


def _looks_like_path(text: str) -> bool:
    if not text or len(text) > 4096 or any(c.isspace() for c in text):
        return False
    return (text.endswith(("/", os.sep)) or text.startswith(("/", "./", "../", "~/"))
            or Path(text).suffix.lower() in (".txt", ".md", ".json", ".jsonl", ".parquet"))


def load_documents(documents: object) -> list[Document]:
    """Normalises what users pass to Engine.build / Engine.add into Documents.

    Accepted: a path (str or os.PathLike naming an existing file or folder), a Document, a dict with 'text' (and
    optionally 'id', 'metadata'), a plain string of text, or a list of any of these. Plain strings that are not
    existing paths are document texts; their id is the first 16 hex digits of their SHA-256. A string that can only
    be a path (one word ending in a path separator, or in .txt/.md/.json/.jsonl, or starting with /, ./, ../ or ~/)
    and names nothing raises FileNotFoundError rather than becoming a one-word document.
    """
    if isinstance(documents, (str, os.PathLike, Document, dict)):
        documents = [documents]
    if not isinstance(documents, Iterable):
        raise TypeError(f"documents must be text, paths, dicts or Documents; got {type(documents).__name__}")
    out: list[Document] = []
    for i, item in enumerate(documents):
        if isinstance(item, Document):
            out.append(item)
        elif isinstance(item, os.PathLike):
            out += read_path(Path(item))
        elif isinstance(item, str):
            found = existing_path(item)
            if found is not None:
                out += read_path(found)
            elif _looks_like_path(item):
                raise FileNotFoundError(f"documents[{i}]: no such file or folder: {item!r} (pass a dict "
                                        "{'text': ...} to index it as text)")
            else:
                check_text(item, f"documents[{i}]")
                out.append(Document(id=hashlib.sha256(item.encode()).hexdigest()[:16], text=item))
        elif isinstance(item, dict):
            if not isinstance(item.get("text"), str):
                raise ValueError(f"documents[{i}] needs a string 'text'")
            check_text(item["text"], f"document {item.get('id', i)!r}'s text")
            doc_id = item["id"] if "id" in item else hashlib.sha256(item["text"].encode()).hexdigest()[:16]
            out.append(Document(id=str(doc_id), text=item["text"], metadata=dict(item.get("metadata") or {})))
        else:
            raise TypeError(f"documents[{i}] must be text, a path, a dict or a Document; got {type(item).__name__}")
    seen = set()
    for d in out:
        _check_document(d)
        if d.id in seen:
            raise ValueError(f"document id {d.id!r} appears more than once")
        seen.add(d.id)
    return out


def check_text(value: str, what: str) -> None:
    """ValueError naming `what` for a string that cannot be written as UTF-8 (a lone surrogate such as '\\ud800')."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid text: {value[exc.start:exc.end]!r} at character {exc.start} is a "
                         "lone surrogate") from None


def _check_document(d: Document) -> None:
    """What the store will write: an id and a text that are valid UTF-8, metadata that is a JSON object."""
    if not isinstance(d.id, str) or not d.id:
        raise ValueError(f"document ids must be non-empty strings; got {d.id!r}")
    check_text(d.id, f"document id {d.id!r}")
    if not isinstance(d.text, str):
        raise ValueError(f"document {d.id!r}: text must be a string")
    check_text(d.text, f"document {d.id!r}'s text")
    if not isinstance(d.metadata, dict):
        raise ValueError(f"document {d.id!r}: metadata must be a dict")
    try:
        json.dumps(d.metadata, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"document {d.id!r}: metadata must be JSON (strings, numbers, booleans, null, lists and "
                         f"objects of them; no NaN): {exc}") from None
