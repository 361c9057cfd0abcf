"""bench/sparse_decode_bench.py: the --smoke path end to end on the CPU (Triton interpreter) writes a computed report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .bench_smoke import ROOT, run_smoke


def test_smoke_writes_a_report_whose_ratios_are_computed_from_its_timings(tmp_path):
    run_smoke("sparse_decode_bench.py", tmp_path)
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


def test_sweep_case_times_every_config_and_checks_each_against_the_first(monkeypatch):
    """--sweep's per-case loop on the CPU (interpreter, tiny case): one row per config, each output compared with
    the first config's (the launch parameters must not change what is computed)."""
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only contract (the GPU runs --sweep itself)")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT))
    from bench.sparse_decode_bench import sweep_case

    configs = [(64, 4, 2), (32, 2, 1), (128, 8, 3)]
    rows = sweep_case("smollm2", 2, 300, 140, "graph", "cpu", 1e12, 4, configs)
    assert [(r["tile"], r["num_warps"], r["num_stages"]) for r in rows] == [c[:3] for c in configs]
    assert all("error" not in r and r["us"] > 0 for r in rows)
    assert rows[0]["max_abs_diff"] == 0.0 and all(r["max_abs_diff"] < 5e-3 for r in rows)
