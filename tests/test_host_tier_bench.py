"""bench/host_tier_bench.py: --help, and the --smoke path end to end on the CPU (Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "host_tier_bench.py"


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_help():
    r = _run("--help")
    assert r.returncode == 0 and "--smoke" in r.stdout and "--out" in r.stdout


def test_smoke_writes_computed_report(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke path is the CPU interpreter run")
    r = _run("--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    js = json.loads((tmp_path / "host_tier.json").read_text())
    md = (tmp_path / "host_tier.md").read_text()
    assert js["errors"] == [] and js["all_samples_bit_exact"] is True and js["gather_path"] == "triton"
    gathers = [x for x in js["results"] if x["kind"] == "gather"]
    saves = [x for x in js["results"] if x["kind"] == "save"]
    assert len(gathers) == 2 and len(saves) == 1
    head = max(gathers, key=lambda x: x["units"])
    assert js["gather_fraction_of_h2d"] == pytest.approx(head["fused_bps"] / js["meta"]["h2d_bps"], rel=1e-12)
    assert head["fused_bps"] == pytest.approx(head["bytes"] / head["fused_s"], rel=1e-12)
    assert js["concurrency_ratio_vs_dense"] is None and "not measured" in js["concurrency_ratio_vs_dense_reason"]
    assert js["gpu"].startswith("none (CPU smoke")
    assert "| page | units |" in md and "## Save" in md and "--smoke" in md
