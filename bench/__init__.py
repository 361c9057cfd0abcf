"""Measuring harness: offline multi-turn long-context benchmark, fidelity metrics
against dense, and serving-load driver (``python -m bench.run_harness``,
``python -m bench.load``)."""
