"""The cross-encoder reranker, fused with the dense score it reranks.

score(q, p) = ce(q, p) + dense_weight * cos(q, p)

ce is a BERT cross-encoder over "[CLS] q [SEP] p [SEP]" with one output logit, started from the bundled MiniLM
weights and trained by certrag (``certrag train-reranker``) with its output layer at zero and dense_weight learned,
so that training starts from the bi-encoder's own ranking and can only move away from it where the data says so.
The weights ship in the package as half-precision safetensors with a card (data, steps, held-out metrics).

backend (certrag.backends): auto | float32 | bfloat16 | int8 (int8, a scale per row, matched float32's MRR@10 and
R@1 on NQ-open test and leaves a pair's score independent of its batch, but is slower than bfloat16 here); the pairs
of a call are scored in length-sorted batches of at most batch_size pairs and max_batch_tokens padded tokens; each
pair is padded to a multiple of pad_grid tokens and batched only with pairs of that width, so its score does not
depend on what it was batched with (the server's dynamic batcher mixes requests). The defaults (16, 32, 4096)
measured fastest here for both long passages and 32-token chunks (bench_encoders.py). The card may hold a skip
rule for adaptive reranking (``skip_rule``: rerank only when the dense ranking's top-1 lead is below a gap fitted on
the train split; see certrag.train.skip_rule).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

# the rerankers that ship in the package, by the name on their card: the one trained here on the NQ-open train split
# (6 layers; `certrag train-reranker`), and the same distilled to 3 layers (`certrag train-reranker --teacher
# certrag/reranker --layers 3`). The 3-layer one is the default: half the cost per pair, and on NQ-open test it ranks
# better (MRR@10 0.897 vs 0.888) and its shipped calibration flags more questions the store cannot answer
# (benchmarks/RESULTS.md). The 6-layer one stays: stores built with it keep it, and it is the 3-layer one's teacher.
L6_RERANKER = "certrag-minilm-cross-encoder"
DEFAULT_RERANKER = "certrag-minilm-l3-cross-encoder"
_HERE = Path(__file__).resolve().parent
PACKAGE_RERANKERS = {L6_RERANKER: _HERE / "reranker", DEFAULT_RERANKER: _HERE / "reranker-l3"}
PACKAGE_RERANKER = PACKAGE_RERANKERS[DEFAULT_RERANKER]


def check_reranker(name: object, argument: str = "reranker") -> str:
    if not isinstance(name, str) or name not in PACKAGE_RERANKERS:
        raise ValueError(f"{argument} must be one of {', '.join(PACKAGE_RERANKERS)}; got {name!r}")
    return name


class CrossEncoderReranker:
    def __init__(self, model_dir: str | os.PathLike = PACKAGE_RERANKER, *, max_length: int = 256,
                 batch_size: int = 32, backend: str = "auto", pad_grid: int = 16, max_batch_tokens: int = 4096,
                 num_threads: int | None = None) -> None:
        from certrag.backends import MAX_PASSES, LazyModel, TorchThread, check_backend, resolve

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
        check_backend(backend)
        if isinstance(pad_grid, bool) or not isinstance(pad_grid, int) or pad_grid < 0:
            raise ValueError(f"pad_grid must be a non-negative integer; got {pad_grid!r}")
        self.pad_grid = pad_grid
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive integer; got {max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        self.num_threads = _threads(num_threads)
        self._thread = TorchThread(self.num_threads, "certrag-rerank") if self.num_threads else None
        self.max_passes = MAX_PASSES  # 1: a call's batches one after another on all threads (backends.passes)

        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"no reranker at {self.model_dir}; train one with `certrag train-reranker`")
        card_path = self.model_dir / "card.json"
        self.card = json.loads(card_path.read_text()) if card_path.exists() else {}
        self.dense_weight = float(self.card.get("dense_weight", 0.0))
        self.name = self.card.get("name", str(self.model_dir))
        self.skip_rule = self.card.get("skip_rule")
        self.backend = resolve(backend)
        self._lazy = LazyModel(lambda torch: _classifier(self.model_dir, torch), self.backend.backend,
                               per_text=pad_grid > 0)
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        # longest_first trims the passage as only_second would whenever the question is the shorter of the two, and
        # trims a question longer than its passage instead of failing ("Second sequence not long enough")
        self._tokenizer.enable_truncation(max_length, strategy="longest_first")
        self._tokenizer.no_padding()  # batches are padded by backends.padded, to a grid, after sorting by length
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._identity = None

    @property
    def model(self):
        """The prepared torch model (loaded on first use)."""
        return self._lazy.get()[1]

    @model.setter
    def model(self, value) -> None:  # another variant of the same weights (bench_encoders: torch's dynamic int8)
        self._lazy.set(value)

    def replica(self, num_threads: int | None = None) -> "CrossEncoderReranker":
        """Another instance over the same weights (shared, read-only) with its own tokenizer, its own lock and
        num_threads torch threads per call: a server runs one per worker, so that passes run side by side where one
        pass leaves cores idle (certrag.runtime.batching)."""
        from tokenizers import Tokenizer

        from certrag.backends import TorchThread

        twin = copy.copy(self)  # shares the LazyModel: the weights load once for all replicas
        twin._tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
        twin._lock = threading.Lock()
        twin.num_threads = _threads(num_threads)
        twin._thread = TorchThread(twin.num_threads, "certrag-rerank") if twin.num_threads else None
        return twin

    @property
    def identity(self) -> dict:
        """What a calibration must match: the name, the SHA-256 of the weights and the fusion weight."""
        if self._identity is None:
            self._identity = identity_of(self.model_dir)
        return self._identity

    @classmethod
    def default(cls, backend: str = "auto", name: str = DEFAULT_RERANKER) -> "CrossEncoderReranker":
        """A reranker shipped in the package (PACKAGE_RERANKERS; the default one unless named), loaded once per
        process, name and backend."""
        from certrag.backends import check_backend

        return _default_reranker(check_backend(backend), check_reranker(name, "name"))

    def cross_scores(self, questions: list[str], passages: list[str], *, batch_size: int | None = None
                     ) -> np.ndarray:
        """ce(q_i, p_i) for aligned lists: float32 (n,). batch_size: pairs per forward pass (default: the
        reranker's)."""
        if len(questions) != len(passages):
            raise ValueError("questions and passages must have the same length")
        batch = self.batch_size if batch_size is None else batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch!r}")
        out = np.zeros(len(passages), dtype=np.float32)
        if not passages:
            return out
        from certrag.backends import padded, passes

        torch, model = self._lazy.get()
        enc = self._tokenizer.encode_batch(list(zip(questions, passages)))

        def run(rows):
            feed = {k: torch.from_numpy(v) for k, v in padded(enc, rows, 0, self.pad_grid).items()}
            out[rows] = model(**feed).logits[:, 0].float().numpy()

        def call():
            passes(torch, [len(e.ids) for e in enc], batch, self.pad_grid, run, max_tokens=self.max_batch_tokens,
                   max_passes=self.max_passes)

        with self._lock:
            if self._thread is not None:
                self._thread.call(call)
            else:
                call()
        return out

    def score(self, question: str, passages: list[str], dense_scores: np.ndarray, *,
              batch_size: int | None = None) -> np.ndarray:
        """Fused rerank scores (logits) of passages for one question: float32 (n,)."""
        return fused_scores(self, question, passages, dense_scores, batch_size=batch_size)


def _classifier(model_dir: Path, torch):
    from certrag import bert

    model = bert.load(model_dir, torch, classifier=True)
    if model is not None:
        return model
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from certrag.backends import quiet_transformers

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    return AutoModelForSequenceClassification.from_pretrained(str(model_dir), config=config, local_files_only=True,
                                                              dtype=torch.float32)


def identity_of(model_dir: str | os.PathLike) -> dict:
    """A reranker folder's identity (CrossEncoderReranker.identity) read from its card and weights, without loading
    the model."""
    import hashlib

    model_dir = Path(model_dir)
    card_path = model_dir / "card.json"
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return {"name": card.get("name", str(model_dir)), "weights_sha256": h.hexdigest()[:16],
            "dense_weight": float(card.get("dense_weight", 0.0))}


def fused_scores(reranker, question: str, passages: list[str], dense_scores: np.ndarray, *,
                 batch_size: int | None = None) -> np.ndarray:
    """ce(q, p) + w * cos(q, p) for one question's passages, with any object that has cross_scores and
    dense_weight (the reranker, or the server's batching view of it): float32 (n,)."""
    dense = np.asarray(dense_scores, dtype=np.float32)
    if dense.shape != (len(passages),):
        raise ValueError(f"dense_scores must have shape ({len(passages)},); got {dense.shape}")
    if not passages:
        return np.zeros(0, dtype=np.float32)
    return (reranker.cross_scores([question] * len(passages), list(passages), batch_size=batch_size)
            + reranker.dense_weight * dense)


@lru_cache(maxsize=4)
def _threads(num_threads: int | None) -> int | None:
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer or None; got {num_threads!r}")
    return num_threads


@lru_cache(maxsize=8)
def _default_reranker(backend: str = "auto", name: str = DEFAULT_RERANKER) -> CrossEncoderReranker:
    return CrossEncoderReranker(PACKAGE_RERANKERS[name], backend=backend)
