"""bench.loopserve_fidelity: the headline JSON is computed from a harness run's records (ratios of each
mode's accuracy to dense per question position; the last-window drop where the question is not last)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from bench.loopserve_fidelity import loopserve_figures, main

RUN = Path(__file__).parents[1] / "tests/data/runs/gpu_psa/summary.json"


def _summary():
    s = json.loads(RUN.read_text())
    s["modes"]["loopserve"] = copy.deepcopy(s["modes"]["psa"])
    lw = copy.deepcopy(s["modes"]["psa"])
    lw["headline"]["accuracy_by_position"] = {"begin": 0.25, "middle": 0.3, "end": 0.9}
    s["modes"]["lastwindow"] = lw
    return s


def test_ratios_are_computed_from_the_run(tmp_path):
    s = _summary()
    figs = loopserve_figures(s)
    dense = s["modes"]["off"]["headline"]["accuracy_by_position"]
    ls = s["modes"]["loopserve"]["headline"]["accuracy_by_position"]
    for pos in ("begin", "middle", "end"):
        assert figs["accuracy_ratio_by_position"][pos] == ls[pos] / dense[pos]
        assert figs["lastwindow_accuracy_ratio_by_position"][pos] == \
            s["modes"]["lastwindow"]["headline"]["accuracy_by_position"][pos] / dense[pos]
    lw = figs["lastwindow_accuracy_ratio_by_position"]
    assert figs["lastwindow_drop_begin_vs_end"] == lw["end"] - lw["begin"] > 0
    assert figs["gpu"] == s["meta"]["gpu"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(s))
    main(["--run", str(run), "--out", str(tmp_path / "f.json")])
    assert json.loads((tmp_path / "f.json").read_text())["accuracy_ratio_by_position"] == \
        figs["accuracy_ratio_by_position"]


def test_a_missing_mode_gives_nulls_not_numbers():
    s = json.loads(RUN.read_text())
    s["modes"]["loopserve"] = copy.deepcopy(s["modes"]["psa"])
    figs = loopserve_figures(s)
    assert figs["lastwindow_accuracy_ratio_by_position"] == {"begin": None, "middle": None, "end": None}
    assert "error" in figs["lastwindow"]


def test_lastwindow_figures_from_a_second_run_use_that_runs_dense(tmp_path):
    """--lastwindow-run: the lastwindow ratios come from the second run, against its own off."""
    s = _summary()
    second = copy.deepcopy(s)
    del s["modes"]["lastwindow"]
    del second["modes"]["loopserve"]
    second["modes"]["off"]["headline"]["accuracy_by_position"] = {"begin": 0.5, "middle": 0.6, "end": 1.0}
    for name, summ in (("a", s), ("b", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summ))
    main(["--run", str(tmp_path / "a"), "--lastwindow-run", str(tmp_path / "b"), "--out", str(tmp_path / "f.json")])
    figs = json.loads((tmp_path / "f.json").read_text())
    lw = second["modes"]["lastwindow"]["headline"]["accuracy_by_position"]
    dense2 = second["modes"]["off"]["headline"]["accuracy_by_position"]
    assert figs["lastwindow_accuracy_ratio_by_position"] == {p: lw[p] / dense2[p] for p in ("begin", "middle", "end")}
    assert figs["accuracy_ratio_by_position"] == loopserve_figures(s)["accuracy_ratio_by_position"]


def test_server_stats_are_the_ones_read_after_the_run():
    """The harness records the mode's statistics at start-up (`reported`, all zero) and after the tasks
    (`reported_after`); the figures take the latter when it is there."""
    s = _summary()
    srv = s["modes"]["loopserve"].setdefault("server", {})
    srv["reported"] = {"stats": {"sparse_decode_rows": 0}}
    srv["reported_after"] = {"stats": {"sparse_decode_rows": 7}}
    assert loopserve_figures(s)["loopserve"]["server_stats"] == {"sparse_decode_rows": 7}
    del srv["reported_after"]
    assert loopserve_figures(s)["loopserve"]["server_stats"] == {"sparse_decode_rows": 0}


CPU_RUN = Path(__file__).parents[1] / "tests/data/runs/cpu_loopserve_lastwindow"


def test_paired_figures_match_the_headline_and_count_the_tasks_that_differ(tmp_path):
    """On a real run's raw records: the paired ratio equals the summary's ratio, the discordant counts
    explain the score difference, and the bootstrap interval contains the ratio."""
    out = tmp_path / "f.json"
    main(["--run", str(CPU_RUN), "--out", str(out)])
    figs = json.loads(out.read_text())
    for mode in ("loopserve", "lastwindow"):
        paired = figs[mode]["paired_by_position"]
        ratios = figs["accuracy_ratio_by_position" if mode == "loopserve" else "lastwindow_accuracy_ratio_by_position"]
        for pos, row in paired.items():
            assert row["n"] == 32
            assert abs(row["ratio"] - ratios[pos]) < 1e-12
            assert row["mode_score"] - row["dense_score"] == row["mode_only"] - row["dense_only"]  # EM tasks: 0/1
            lo, hi = row["ratio_ci95"]
            assert lo <= row["ratio"] <= hi


def test_paired_interval_is_a_point_when_the_runs_agree_and_wide_when_they_differ():
    from bench.paired import paired_by_position
    from bench.tasks import PRESETS

    raw = json.loads((CPU_RUN / "raw" / "off.json").read_text())
    same = paired_by_position(raw, raw, PRESETS["cpu"])
    for row in same.values():
        assert row["mode_only"] == row["dense_only"] == 0 and row["ratio"] == 1.0 and row["ratio_ci95"] == [1.0, 1.0]
    flipped = copy.deepcopy(raw)  # the mode loses the first 4 middle tasks dense answered right
    lost = 0
    for t in flipped["tasks"]:
        last = t["turns"][-1]
        if t["position"] == "middle" and t["kind"] in ("needle", "recall", "multidoc") and last["score"] == 1 and lost < 4:
            last["score"] = 0.0
            lost += 1
    row = paired_by_position(raw, flipped, PRESETS["cpu"])["middle"]
    assert (row["dense_only"], row["mode_only"]) == (4, 0)
    assert row["ratio"] == (row["dense_score"] - 4) / row["dense_score"]
    assert row["ratio_ci95"][0] < row["ratio"] < row["ratio_ci95"][1] < 1.0 + 1e-12
