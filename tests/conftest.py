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
