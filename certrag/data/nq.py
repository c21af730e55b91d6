"""NQ-open with gold passages (Liu et al., 2023, "Lost in the Middle"), and its fixed train/calibration/test split.

The split is made once, deterministically, by a stable hash of the question text (never by file order or a random
generator's state): 40% train, 20% calibration, 40% test (DESIGN.md). Anything learned learns from train,
conformal calibration uses calibration, and every reported number uses test.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from certrag.data.splits import SPLITS, split_of


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    title: str  # gold passage
    passage: str

    @property
    def split(self) -> str:
        return split_of(self.question)

    @property
    def gold_text(self) -> str:
        """The gold passage as certrag indexes it: title, newline, text."""
        return passage_text(self.title, self.passage)


def passage_text(title: str, text: str) -> str:
    return f"{title}\n{text}" if title else text


BUNDLED = Path(__file__).resolve().parent / "nq-open-oracle.jsonl.gz"  # shipped with certrag: NQ-OPEN-NOTICE.md


def default_path() -> Path:
    """$CERTRAG_NQ_PATH when set (a copy of the same file elsewhere), else the file shipped in the package."""
    env = os.environ.get("CERTRAG_NQ_PATH")
    return Path(env) if env else BUNDLED


def load_nq_open(path: str | os.PathLike | None = None, split: str | None = None) -> list[QAItem]:
    """The items of one split (or all, with split=None), in file order."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    path = Path(path) if path is not None else default_path()
    opener = gzip.open if path.suffix == ".gz" else open
    items = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            answers = row["answers"]
            if isinstance(answers, str):
                answers = ast.literal_eval(answers)
            ctx = row["ctxs"][0] if row.get("ctxs") else {"title": "", "text": ""}
            item = QAItem(question=row["question"], answers=tuple(str(a) for a in answers),
                          title=ctx.get("title", ""), passage=ctx.get("text", ""))
            if split is None or item.split == split:
                items.append(item)
    return items


def split_counts(items: list[QAItem]) -> dict[str, int]:
    counts = {s: 0 for s in SPLITS}
    for it in items:
        counts[it.split] += 1
    return counts
