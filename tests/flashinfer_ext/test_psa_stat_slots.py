"""Contract: PsaDecodeWrapper's per-run statistics (``kept_est``, ``probe_nread``) land in the slot a run names and
stay there through later runs into other slots, so a caller sums every layer's once per step (the server's runner
does, after the last layer) and gets what summing after each run gave; both schedules."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.psa.config import PsaDecodeConfig

from .kv_pool import make_pool
from .test_psa_sketch_select import _build


@pytest.mark.parametrize("schedule", ["select", "progressive"])
def test_each_run_keeps_its_statistics_in_its_slot(schedule):
    cfg = PsaDecodeConfig(epsilon=0.9, sink_blocks=1, local_blocks=1, criticality="sketch", estimator="sketch",
                          schedule=schedule)
    pool_a = make_pool([30 * 16 + 5, 12 * 16], 9, 3, 64, torch.bfloat16, 16, seed=3, planted=True)
    pool_b = make_pool([30 * 16 + 5, 12 * 16], 9, 3, 64, torch.bfloat16, 16, seed=8, planted=True)
    alone = []
    for pool in (pool_a, pool_b):  # each layer's statistics from a wrapper of one slot
        w, sp = _build(pool, cfg, 16)
        w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
        alone.append((w.probe_nread.clone(), w.kept_est.clone()))
    assert not torch.equal(alone[0][0], alone[1][0])  # the two "layers" read differently

    w, sp = _build(pool_a, cfg, 16, stat_slots=2)
    with pytest.raises(ValueError, match="stat_slots=0"):
        _build(pool_a, cfg, 16, stat_slots=0)
    w.run(pool_a.q, pool_a.k_buffer, pool_a.v_buffer, *sp.layer(0), slot=0)
    w_b, sp_b = _build(pool_b, cfg, 16)  # pool_b's rows and block table, planned into the same wrapper
    w.plan(pool_b.req_to_token, pool_b.req_pool_indices, pool_b.seq_lens, w_b._block_table_buf[:2])
    w.run(pool_b.q, pool_b.k_buffer, pool_b.v_buffer, *sp_b.layer(0), slot=1)
    assert w.probe_nread_slots.shape == (2, 2, 3) and w.kept_est_slots.shape == (2, 2, 3)
    for slot, (nread, kept) in enumerate(alone):
        assert torch.equal(w.probe_nread_slots[slot], nread)
        torch.testing.assert_close(w.kept_est_slots[slot], kept, rtol=0, atol=0)
    assert torch.equal(w.probe_nread, alone[1][0]) and torch.equal(w.kept_est, alone[1][1])  # the last run's slot
    total = torch.sum(w.probe_nread_slots, (0, 2), dtype=torch.float32)
    assert total.tolist() == (alone[0][0].sum(1) + alone[1][0].sum(1)).float().tolist()
