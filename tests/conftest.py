import numpy as np
import pytest

from certrag.datasets import clustered_vectors


@pytest.fixture(scope="session")
def clustered_1001():
    base, queries = clustered_vectors(1001, 48, n_queries=97, latent_dim=12, seed=7)
    return base, queries


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


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
