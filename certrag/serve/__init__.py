"""The HTTP face: certrag serve (app.py, a FastAPI application over an Engine and a local model)."""

from certrag.serve.app import create_app

__all__ = ["create_app"]
