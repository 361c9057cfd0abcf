"""bench/loopserve_step_bench.py: the --smoke path runs the server's LoopServe runner for a selecting step (its LSE
pass split into key spans, and not; lists from the rows' bases, and sort-based), and a steady decode step (lists from
the sorted bases, and sort-based) on the CPU (Triton interpreter) and writes its report."""

from __future__ import annotations

import json

from .bench_smoke import run_smoke


def test_smoke_times_selecting_steps_split_and_unsplit_and_steady_steps_and_writes_the_report(tmp_path):
    run_smoke("loopserve_step_bench.py", tmp_path)
    js = json.loads((tmp_path / "loopserve_step.json").read_text())
    # the bench asserts each step's kind; the smoke's selecting step splits its LSE pass, the unsplit one does not
    # (the CUDA-graph kind runs on a GPU only)
    assert [row["kind"] for row in js["rows"]] == ["selecting", "selecting_unsplit", "selecting_sorted", "steady",
                                                   "steady_sorted"]
    assert [row["lse_splits"] for row in js["rows"]] == [5, 1, 5, None, None]  # 300 keys in spans of 64; one span
    for row in js["rows"]:
        assert row["step_ms"] > 0 and row["plan_ms"] > 0 and row["host_ms"] > 0
    assert js["meta"]["smoke"] is True and js["meta"]["gpu"] is None
    md = (tmp_path / "loopserve_step.md").read_text()
    assert "| smoke | selecting |" in md and "Steady step, sort-based lists / lists from the sorted bases" in md
