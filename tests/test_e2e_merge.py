"""Contract: merging e2e_long.json documents keeps each mode's ratios from its own invocation (against that
invocation's off), records where each mode came from and how far the off baselines differ, and refuses a merge
across GPUs or of a mode the source lacks."""

from __future__ import annotations

import pytest

from bench.e2e_merge import merge


def _doc(gpu, off_tps, modes):
    return {"gpu": gpu, "modes": {"off": {"4k_c1": {"throughput_ratio_vs_off": 1.0, "output_throughput_tok_s": off_tps}},
                                  **modes}}


def test_merge_keeps_each_modes_own_ratios_and_records_sources():
    a = _doc("H100", 600.0, {"psa": {"4k_c1": {"throughput_ratio_vs_off": 0.4}}})
    b = _doc("H100", 630.0, {"lastwindow": {"4k_c1": {"throughput_ratio_vs_off": 0.5}}})
    out = merge(a, [(b, ["lastwindow"], "b.json")], "a.json")
    assert out["modes"]["psa"]["4k_c1"]["throughput_ratio_vs_off"] == 0.4
    assert out["modes"]["lastwindow"]["4k_c1"]["throughput_ratio_vs_off"] == 0.5
    assert out["mode_sources"] == {"off": "a.json", "psa": "a.json", "lastwindow": "b.json"}
    assert out["off_spread"]["4k_c1"] == pytest.approx(0.05)


def test_merge_refuses_other_gpus_and_missing_modes():
    a = _doc("H100", 600.0, {})
    with pytest.raises(SystemExit, match="ran on"):
        merge(a, [(_doc("H200", 600.0, {}), ["off"], "b.json")], "a.json")
    with pytest.raises(SystemExit, match="no mode 'psa'"):
        merge(a, [(_doc("H100", 600.0, {}), ["psa"], "b.json")], "a.json")


def test_merge_of_cells_replaces_only_the_named_cells_of_a_mode():
    a = _doc("H100", 600.0, {"loopserve": {"4k_c1": {"throughput_ratio_vs_off": 0.9},
                                           "32k_c1": {"throughput_ratio_vs_off": 0.08}}})
    c = _doc("H100", 610.0, {"loopserve": {"32k_c1": {"throughput_ratio_vs_off": 0.23}}})
    out = merge(a, [(c, ["loopserve@32k_"], "c.json")], "a.json")
    assert out["modes"]["loopserve"]["4k_c1"]["throughput_ratio_vs_off"] == 0.9
    assert out["modes"]["loopserve"]["32k_c1"]["throughput_ratio_vs_off"] == 0.23
    assert out["mode_sources"]["loopserve"] == "a.json" and out["cell_sources"] == {"loopserve": {"32k_c1": "c.json"}}
    with pytest.raises(SystemExit, match="no 'loopserve' cell"):
        merge(a, [(c, ["loopserve@64k_"], "c.json")], "a.json")
