"""Tests of the benchmarks: ``bench`` is a package, imported from the repository root."""
