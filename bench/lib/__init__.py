"""Shared pieces of the benchmarks (see ``bench/__init__.py``)."""
