"""Benchmarks: plait measured against its peers in the same run."""
