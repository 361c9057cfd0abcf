"""Contract: bench/lines_union_bench.py times every block width on the same inputs and reports whether each block
wrote the first block's lists (the kernels' output must not depend on the block). CPU: its per-case loop under the
Triton interpreter with the timing stubbed (no speed claim); the GPU runs the bench itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_lines_union_bench_checks_each_blocks_lists_against_the_first(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only contract (the GPU runs the bench itself)")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT))
    import bench.lines_union_bench as lub

    calls = []
    monkeypatch.setattr(lub, "graph_us", lambda fn, **kw: (fn(), calls.append(fn), 1.0)[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    rows = lub.run_case(1, 120, 20, [32, 1024], torch.device("cpu"))
    assert [r["block"] for r in rows] == [32, 1024]
    assert all(r["same_lists_as_first_block"] for r in rows)
    assert len(calls) == 4  # lines_union and lines_append timed per block
