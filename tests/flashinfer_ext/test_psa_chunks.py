"""Contract: the host wave plan covers every chunk once, in order; the bound suffix equals its fp32 reference."""

from __future__ import annotations

import math

import pytest
import torch

from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.criticality import bound_suffix
from flashinfer_ext.psa.chunks import plan_waves
from flashinfer_ext.common.reference import bound_suffix_reference


@pytest.mark.parametrize("n_ranked,pairs,target,growth", [(8189, 64, 528, 2.0), (8189, 2048, 528, 2.0),
                                                          (40, 3, 1, 1.0), (1, 8, 64, 2.0), (300, 1, 4, 4.0)])
def test_wave_plan_covers_every_chunk_once(n_ranked, pairs, target, growth):
    ends = PsaDecodeConfig().ranked_chunk_ends(n_ranked)
    waves = plan_waves(ends, pairs, target_programs=target, growth=growth, max_waves=12)
    assert waves[0][0] == 0 and all(n >= 1 for _, n in waves) and len(waves) <= 12
    assert [c for c0, n in waves for c in range(c0, c0 + n)] == list(range(len(ends) + 1))
    assert waves[0][1] >= min(len(ends) + 1, 2, -(-target // pairs))
    # every wave after the first ends at >= growth x the ranks covered before it (or at the end)
    for (p0, pn), (c0, n) in zip(waves, waves[1:]):
        before = ends[p0 + pn - 2] if p0 + pn >= 2 else 0
        assert ends[c0 + n - 2] >= min(growth * before, ends[-1]) or c0 + n == len(ends) + 1


def test_wave_plan_of_128k_batch_8_is_short():
    ends = PsaDecodeConfig().ranked_chunk_ends(8192 - 3)
    waves = plan_waves(ends, 64, target_programs=528, growth=2.0)
    assert len(waves) <= 9  # fixed launch count: 2 launches per wave


@pytest.mark.parametrize("tile,given_scratch", [(16, False), (1024, False), (16, True), (32, True), (1024, True)])
def test_bound_suffix_matches_reference(tile, given_scratch):
    """The tile-parallel suffix (per-tile log-sums, then each tile's scan plus the carry of the tiles after it), with a
    caller's scratch or its own, equals the reference: one tile, many tiles, partial last tiles, gathered ranks."""
    from flashinfer_ext.psa.criticality import suffix_tiles

    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 53, generator=g) * 30
    s[..., :2] = float("inf")   # forced blocks
    s[0, :, 40:] = float("-inf")  # past the end
    s = s.sort(-1, descending=True).values.contiguous()
    out = torch.empty(2, 3, 60)
    tiles = torch.empty(2 * 3 * suffix_tiles(53, tile)) if given_scratch else None
    bound_suffix(s, out, sm_scale=0.125, block_size=16, tile=tile, tiles_buf=tiles)
    for r in range(2):
        for h in range(3):
            ref = bound_suffix_reference(s[r, h], sm_scale=0.125, block_size=16)
            fin = torch.isfinite(ref)
            assert torch.equal(torch.isinf(out[r, h, :54]), ~fin)
            torch.testing.assert_close(out[r, h, :54][fin], ref[fin], rtol=1e-5, atol=1e-4)
    # the suffix bounds the numerator sum of any keys whose q.k stays under the block score
    assert math.isclose(float(out[1, 0, 52]), 0.125 * float(s[1, 0, 52]) / math.log(2) + 4, rel_tol=1e-5)
    # scores in block order read through a rank -> block order give the same suffix
    perm = torch.randperm(53, generator=g)
    order = torch.argsort(perm).expand(2, 3, 53).contiguous()
    gathered = torch.empty(2, 3, 60)
    bound_suffix(s[..., perm].contiguous(), gathered, sm_scale=0.125, block_size=16, tile=tile, tiles_buf=tiles,
                 order=order)
    torch.testing.assert_close(gathered[..., :54], out[..., :54], rtol=1e-6, atol=1e-5)
