"""Triton kernels, imported as ``certrag.kernels``.

Nothing here is imported by ``import certrag``; each kernel module imports triton itself when loaded.
"""
