"""Benchmarks run by ``python -m qfa bench ...``: figures beside references measured in the same run."""
