"""The LoopServe prefill benchmark runs end to end on the CPU (`--smoke`: Triton interpreter, tiny
shapes, torch reference for the dense side) and writes its report with computed figures: the
context below min_context is served dense, the one above sparse, the sparse output stays close to
dense attention and uses fewer lines than dense."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_prefill_bench_smoke_writes_computed_report(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "loopserve_prefill_bench.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    data = json.loads((tmp_path / "loopserve_prefill.json").read_text())
    assert {"gpu", "speedup_128k", "speedup_32k", "speedup_4k", "results", "meta"} <= set(data)
    rows = data["results"]
    assert [r.get("error") for r in rows] == [None, None]
    assert [r["served"] for r in rows] == ["dense", "sparse"]  # smoke min_context 128: ctx 96 / 160
    for row in rows:
        assert 0 < row["line_fraction"] < 1
        assert math.isfinite(row["out_err_mean"]) and row["out_err_mean"] < 0.05
        assert row["covered_lb_mean"] >= 0.955 - 1e-4
    assert (tmp_path / "loopserve_prefill.md").read_text().startswith("# LoopServe sparse prefill")
