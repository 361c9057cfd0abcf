"""bench/loopserve_step_bench.py: the --smoke path runs the server's LoopServe runner for a selecting and a steady
decode step on the CPU (Triton interpreter) and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_times_a_selecting_and_a_steady_step_and_writes_the_report(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke path is the CPU interpreter run")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "loopserve_step_bench.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    js = json.loads((tmp_path / "loopserve_step.json").read_text())
    assert [row["kind"] for row in js["rows"]] == ["selecting", "steady"]  # the bench asserts each step's kind
    for row in js["rows"]:
        assert row["step_ms"] > 0 and row["plan_ms"] > 0 and row["host_ms"] > 0
    assert js["meta"]["smoke"] is True and js["meta"]["gpu"] is None
    assert "| smoke | selecting |" in (tmp_path / "loopserve_step.md").read_text()
