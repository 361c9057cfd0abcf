"""Contract: ``bench.psa_read_floor`` turns ``bench.psa_real_capture`` summaries into one row per (captured step,
config) with the read fraction, the kept mass, the pairs that went wrong and the blocks each order needs; configs
without a summary are skipped and an input without any is refused."""

from __future__ import annotations

import json

import pytest

from bench.psa_read_floor import main, rows_of


def _summary(read: float, out_errs: list[float]) -> dict:
    pairs = [{"out_err": e, "needle_read": e < 0.5} for e in out_errs]
    return {"runs": [{"prompt_len": 16169, "depth": 0.9, "seed": 1, "dense_correct": True, "variants": {
        "default": {"analysis": {"rows": pairs}, "summary": {
            "read_frac": read, "kept_true_min": 0.999,
            "blocks95_mean": {"mean": 0.31, "median": 0.2, "max": 0.86},
            "blocks95_cuboid": {"mean": 0.24, "median": 0.22, "max": 0.87},
            "blocks95_oracle": {"mean": 0.14, "median": 0.1, "max": 0.8}}},
        "old": {"analysis": {"rows": pairs}}}}]}


def test_one_row_per_summarised_config_with_the_pairs_counted():
    rows = rows_of(_summary(0.9, [0.01, 0.2, 0.7]))
    assert len(rows) == 1
    r = rows[0]
    assert (r["config"], r["read_frac"], r["pairs"], r["pairs_out_err_gt_0.1"], r["needle_unread_pairs"]) == \
        ("default", 0.9, 3, 2, 1)
    assert (r["blocks95_mean_order"], r["blocks95_oracle"], r["blocks95_oracle_max"]) == (0.31, 0.14, 0.8)


def test_report_files_hold_the_rows(tmp_path):
    src = tmp_path / "summary_16000.json"
    src.write_text(json.dumps(_summary(0.737, [0.0])))
    assert main([str(src), "--out", str(tmp_path / "r"), "--command", "cmd"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["read_frac"] == 0.737
    md = (tmp_path / "r.md").read_text()
    assert "| 16169 | 90% | default | 0.737 |" in md and "`cmd`" in md


def test_summaries_without_any_analysed_config_are_refused(tmp_path):
    src = tmp_path / "s.json"
    s = _summary(0.9, [0.0])
    del s["runs"][0]["variants"]["default"]
    src.write_text(json.dumps(s))
    with pytest.raises(SystemExit):
        main([str(src), "--out", str(tmp_path / "r")])
