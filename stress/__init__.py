"""Concurrency stress suite (python -m stress)."""
