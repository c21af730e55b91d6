"""CERTRAG_HOME: the one cache folder for everything certrag makes on first use (converted models, embedding caches,
fetched training text, demo stores). Default: ~/.cache/certrag."""

from __future__ import annotations

import os
from pathlib import Path


def certrag_home() -> Path:
    """The cache folder (created when missing): $CERTRAG_HOME, else ~/.cache/certrag."""
    root = Path(os.environ.get("CERTRAG_HOME") or Path.home() / ".cache" / "certrag")
    root.mkdir(parents=True, exist_ok=True)
    return root
