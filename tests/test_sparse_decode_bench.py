"""bench/sparse_decode_bench.py: the --smoke path end to end on the CPU (Triton interpreter) writes a computed report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_writes_a_report_whose_ratios_are_computed_from_its_timings(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke path is the CPU interpreter run")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_decode_bench.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    js = json.loads((tmp_path / "sparse_decode.json").read_text())
    (res,) = js["results"]
    assert res["num_splits"] > 1  # the smoke lists span several tiles: the split path is exercised
    assert res["split_speedup_vs_one_program"] == pytest.approx(res["us"]["one_program"] / res["us"]["split"])
    assert res["max_abs_diff_split_vs_one_program"] < 5e-2  # same lists, same attention
    assert "| shape | batch |" in (tmp_path / "sparse_decode.md").read_text()


def test_without_a_gpu_only_the_smoke_runs(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only contract")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_decode_bench.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--smoke" in r.stderr
