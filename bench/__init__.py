"""Benchmarks of ddtree-serve (run from the repository root: `python -m bench.acceptance`, `python -m bench.speed`)."""
