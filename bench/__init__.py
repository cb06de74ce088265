"""Benchmarks: each prints JSON and compares against a baseline measured in the same run."""
