"""bench.line_work counts what a vertical/slash line set costs: checked against a brute-force mask and tile walk."""

import pytest
import torch

from bench.line_work import line_work


def brute(v, s, t, bq, bn):
    rows = torch.arange(t)[:, None]
    keys = torch.arange(t)[None, :]
    causal = keys <= rows
    vm = torch.zeros(t, dtype=torch.bool)
    vm[v] = True
    sm = torch.zeros(t, dtype=torch.bool)
    sm[s] = True
    off = (rows - keys).clamp(min=0)
    mask = causal & (vm[None, :] | sm[off])
    area = mask.sum().item() / causal.sum().item()
    dense = a = b = 0
    for q0 in range(0, t, bq):
        q_hi = min(q0 + bq, t) - 1
        nkb = q_hi // bn + 1
        dense += nkb
        a += -(-int((v <= q_hi).sum()) // bn)
        for kb in range(nkb):  # a key block is crossed iff an entry of its tile lies on a selected slash
            tile = (rows[q0:q_hi + 1] - keys[:, kb * bn: kb * bn + bn])
            ok = (tile >= 0) & sm[tile.clamp(min=0)]
            b += int(ok.any())
    return area, a / dense, b / dense


@pytest.mark.parametrize("t,bq,bn,nv,ns,seed", [(97, 16, 16, 9, 7, 0), (130, 8, 32, 20, 3, 1), (64, 16, 64, 0, 5, 2),
                                                 (50, 4, 8, 12, 0, 3)])
def test_line_work_matches_a_brute_force_count_of_entries_and_tiles(t, bq, bn, nv, ns, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randperm(t, generator=g)[:nv].sort().values
    s = torch.randperm(t, generator=g)[:ns].sort().values
    w = t
    v_idx = torch.full((1, w), -1, dtype=torch.int32)
    s_idx = torch.full((1, w), -1, dtype=torch.int32)
    v_idx[0, :nv] = v.int()
    s_idx[0, :ns] = s.int()
    got = line_work(v_idx, torch.tensor([nv]), s_idx, torch.tensor([ns]), t, block_q=bq, block_n=bn)
    area, fa, fb = brute(v, s, t, bq, bn)
    assert got["area_fraction"] == pytest.approx(area)
    assert got["tile_fraction_a"] == pytest.approx(fa)
    assert got["tile_fraction_b"] == pytest.approx(fb)
    assert got["tile_fraction"] == pytest.approx(fa + fb)


def test_every_line_selected_is_the_whole_causal_matrix_and_every_tile():
    t = 40
    idx = torch.arange(t, dtype=torch.int32)[None]
    got = line_work(idx, torch.tensor([t]), idx, torch.tensor([t]), t, block_q=8, block_n=8)
    assert got["area_fraction"] == pytest.approx(1.0)
    assert got["tile_fraction_b"] == pytest.approx(1.0)
