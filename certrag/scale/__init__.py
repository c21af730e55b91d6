"""certrag past one machine, on Ray (`pip install certrag[ray]`): indexing as a Ray Data job
(certrag.scale.indexing), a sharded store's shards as Ray actors (certrag.shards.RayShardedIndex), and the HTTP
service on Ray Serve with retrieval and generation as separate deployments (certrag.scale.serving). Importing
this package does not import Ray; each entry point does, with a clear error when it is missing."""

from __future__ import annotations

from certrag.scale.cluster import connect, require_ray


def index_on_ray(*args, **kwargs):
    """certrag.scale.indexing.index_on_ray (documented there)."""
    from certrag.scale.indexing import index_on_ray as run

    return run(*args, **kwargs)


__all__ = ["connect", "index_on_ray", "require_ray"]
