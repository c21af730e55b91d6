import os

import numpy as np
import pytest


def _interpret_triton_without_a_gpu() -> None:
    """Kernels run under Triton's interpreter on machines without a GPU; the variable must be set before any kernel
    is decorated, so it is set here, before test modules import."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()

from certrag.data.vectors import clustered_vectors


@pytest.fixture(scope="session")
def clustered_1001():
    base, queries = clustered_vectors(1001, 48, n_queries=97, latent_dim=12, seed=7)
    return base, queries


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def bench_dirs(tmp_path, monkeypatch):
    """benchmarks/ importable, its scratch (DATA_DIR) and results (RESULTS_DIR) moved to tmp_path/data and
    tmp_path/results: a benchmark's bookkeeping tested without touching the repository's runs."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _common

    for name, attr in (("data", "DATA_DIR"), ("results", "RESULTS_DIR")):
        (tmp_path / name).mkdir()
        monkeypatch.setattr(_common, attr, tmp_path / name)
    return tmp_path


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (the small bundled model for tests), loaded once per session."""
    pytest.importorskip("torch")
    from certrag.llm import LocalLLM
    from certrag.llm.models import BUNDLED_MODELS

    try:
        BUNDLED_MODELS["smollm2-135m-instruct"].gguf_parts()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return LocalLLM("smollm2-135m-instruct")
