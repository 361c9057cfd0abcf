"""Shared by the bench --smoke tests: run a bench script's CPU smoke path in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_smoke(script: str, out: Path, timeout: int = 300) -> None:
    """``python bench/<script> --smoke --out OUT`` on the CPU (skipped with a GPU: the smoke path is the
    interpreter run); fails with the script's stderr tail if it exits non-zero."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke path is the CPU interpreter run")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
