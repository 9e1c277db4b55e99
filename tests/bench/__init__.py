"""Smoke tests of the benchmarks in ``bench/``: they run with tiny sizes; no timing is asserted."""
