"""Benchmarks: every figure is a ratio against a baseline timed in the same run."""
