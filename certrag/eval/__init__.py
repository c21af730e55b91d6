"""Evaluation on top of the engine: the QA harness (qa.py) and its metrics (metrics.py). Imported by the CLI,
the benchmarks and the training wing; never by a stage below the engine."""
