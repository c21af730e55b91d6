"""Stable hashing: fractions and splits fixed by a key alone, never by file order or a random generator's state.

Every deterministic split in certrag (NQ-open's train / calibration / test, the conformal hold-out, the reranker's
and segmenter's validation sets, the factuality classifier's gold-passage choice) draws its number here.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "calibration", "test")


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by the key alone: the first 8 bytes of SHA-256(key, UTF-8) over 2**64."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def stable_seed(key: str) -> int:
    """A 32-bit seed fixed by the key alone (the first 4 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:4], "big")


def normalise_question(question: str) -> str:
    """Lower case, surrounding and repeated white space folded: the key a question is hashed by."""
    return " ".join(question.strip().lower().split())


def split_of(question: str) -> str:
    """train (40%), calibration (20%) or test (40%), from the stable fraction of the normalised question text."""
    x = stable_fraction(normalise_question(question))
    return "train" if x < 0.4 else ("calibration" if x < 0.6 else "test")
