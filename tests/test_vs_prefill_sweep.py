"""bench.vs_prefill_sweep's table: per launch shape, kernel time summed over layers, ranked, against the default."""

import math

import pytest

from bench.vs_prefill_sweep import DEFAULT, configs, summarize


def _row(layer, t, dense, diff=0.0, **cfg):
    return dict(layer=layer, ctx=100, **{**DEFAULT, **cfg}, t_ms=t, t_dense_ms=dense, max_abs_diff_vs_default=diff)


def test_summary_sums_layers_ranks_fastest_first_and_skips_failed_or_untimed_runs():
    rows = [_row(3, 10.0, 2.0), _row(15, 12.0, 2.0),
            _row(3, 4.0, 2.0, 0.01, block_m=128, num_warps=8), _row(15, 5.0, 2.0, 0.02, block_m=128, num_warps=8),
            dict(layer=3, **{**DEFAULT, "block_n": 128}, error="OutOfResources"),
            _row(3, math.nan, math.nan, block_n=32)]
    s = summarize(rows)
    assert [x["config"] for x in s] == ["m128 n- w8 s-", "m64 n- w- s-"]
    fast, base = s
    assert fast["t_ms"] == pytest.approx(9.0) and fast["layers"] == 2 and fast["max_abs_diff"] == 0.02
    assert fast["default_over_this"] == pytest.approx(22.0 / 9.0)
    assert fast["dense_over_sparse"] == pytest.approx(4.0 / 9.0)
    assert base["default_over_this"] == pytest.approx(1.0)


def test_the_grid_starts_with_the_default_and_holds_every_combination():
    grid = configs(smoke=False)
    assert grid[0] == DEFAULT and len(grid) == 1 + 2 * 3 * 2 * 3
    assert len({tuple(sorted(c.items(), key=str)) for c in grid[1:]}) == len(grid) - 1
