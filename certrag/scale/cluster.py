"""Joining or starting the Ray cluster that certrag.scale runs on."""

from __future__ import annotations


def require_ray():
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError("this needs Ray: pip install 'certrag[ray]'") from None
    return ray


def connect(address: str | None = None, *, num_cpus: int | None = None):
    """Joins the Ray cluster at address ("auto": the one this machine belongs to; "ray://host:10001": a remote one)
    or, with address None, starts a local one in this process. Does nothing when Ray is already initialised."""
    ray = require_ray()
    if not ray.is_initialized():
        if address in (None, "", "local"):
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    return ray
