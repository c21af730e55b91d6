"""Evaluation data and metrics."""
