"""``bench/psa_decode_bench.py --merge-ab``: every case runs once per merge variant (separate merge launches, then
fused), in one process, and the report names each row's variant; without timing (CPU) the rows say so instead of
inventing figures."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

torch = pytest.importorskip("torch")


def test_merge_ab_runs_both_variants_per_case_and_labels_them(tmp_path):
    import psa_decode_bench
    from bench import psa_plans

    run_case = functools.partial(psa_decode_bench.run_case, timing=False, hq=8, hk=2, d=64)
    meta = dict(command="test", gpu="CPU", versions="-", peak_bps=float("nan"))
    rows = psa_plans.run_stage_profile(run_case, tmp_path, meta, "cpu", cases=((2, 300, 16),),
                                       variants=psa_plans.MERGE_VARIANTS)
    assert [r["variant"] for r in rows] == [label for label, _ in psa_plans.MERGE_VARIANTS]
    assert [r["fused_merge"] for r in rows] == [False, True]
    assert rows[0]["blocks_read"] == rows[1]["blocks_read"]  # same stop points: the fusion changes no result
    data = json.loads((tmp_path / "psa_merge_ab.json").read_text())
    assert len(data["results"]) == 2
    md = (tmp_path / "psa_merge_ab.md").read_text()
    assert "fused merge" in md and "separate merge launches" in md and "no GPU timing" in md
