"""Benchmark scripts: they print tables; none of them is a test."""
