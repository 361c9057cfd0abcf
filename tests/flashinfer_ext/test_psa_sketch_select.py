"""Contract: PSA's 'select' schedule (flashinfer_ext.psa.sketch_select) picks the sketch's top-p blocks as its fp64
reference does — forced blocks in, the cap and epsilon >= 1 honoured, the unread approximate share within budget —
and the wrapper run on that schedule equals exact attention over the selected blocks, is dense at epsilon 1.0, keeps
epsilon of the true mass on planted structure and agrees with the CPU server's reference pipeline."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.reference import dense_decode_reference, kept_mass_reference, psa_decode_reference
from flashinfer_ext.psa.block_meta import identity_block_table, paged_block_table
from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.decode import PsaDecodeWrapper
from flashinfer_ext.psa.key_sketch import KeySketchPool
from flashinfer_ext.psa.sketch_select import SEARCH_FLOOR, SEARCH_STEPS, sketch_select, sketch_select_reference

from .kv_pool import make_pool

SELECT = dict(criticality="sketch", estimator="sketch", schedule="select")


def _select(mass, seq_lens, eps, caps, probe_eps, probe_caps, *, block_size, sink=1, local=2, slack=2.0):
    b, h, _, c = mass.shape
    out = dict(scores_out=torch.empty(b, h, c), lists_out=torch.full((b, h, c), -1, dtype=torch.int64),
               list_lens_out=torch.zeros(b, h, dtype=torch.int32), probe_out=torch.zeros(b, h, dtype=torch.int32),
               kept_out=torch.zeros(b, h), totals_out=torch.zeros(b * h * mass.shape[2]))
    sketch_select(mass, seq_lens, eps, caps, probe_eps, probe_caps, block_size=block_size, sink_blocks=sink,
                  local_blocks=local, calib_slack=slack, **out)
    return out


def _masses(seed, batch, hk, group, cols, seq_lens, block_size, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    mass = torch.randn(batch, hk, group, cols, generator=g) * spread
    for r, n in enumerate(seq_lens):
        mass[r, :, :, -(-n // block_size):] = float("-inf")
    return mass


@pytest.mark.parametrize("group,block_size,cols,spread", [(3, 16, 70, 4.0), (1, 16, 300, 2.0), (4, 32, 129, 8.0),
                                                          (2, 1, 40, 1.0)])
def test_selection_equals_reference_and_keeps_the_budget(group, block_size, cols, spread):
    seq_lens = [cols * block_size - 3, (cols // 2) * block_size, 5 * block_size + 1]
    mass = _masses(group + cols, 3, 2, group, cols, seq_lens, block_size, spread)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    eps = torch.tensor([0.95, 0.8, 0.9])
    nb = [-(-n // block_size) for n in seq_lens]
    caps = torch.tensor([[nb[0], nb[0]], [nb[1], 10], [nb[2], nb[2]]], dtype=torch.int32)
    out = _select(mass, sl, eps, caps, eps, caps[:, 0].contiguous(), block_size=block_size)
    lists, kept = sketch_select_reference(mass, sl, eps, caps, block_size=block_size, sink_blocks=1, local_blocks=2,
                                          calib_slack=2.0)
    for r in range(3):
        for h in range(2):
            n = int(out["list_lens_out"][r, h])
            got = out["lists_out"][r, h, :n].tolist()
            assert got == lists[r][h], (r, h)
            assert {0, nb[r] - 1, nb[r] - 2} <= set(got)  # sink and local blocks always read
            assert n <= max(int(caps[r, h]), 3)
            # what is left unread is within the budget where no cap limits the list
            if int(caps[r, h]) >= nb[r]:
                assert float(out["kept_out"][r, h]) >= float(eps[r]) - 1e-6
                unread = sorted(set(range(nb[r])) - set(got))
                m = mass[r, h, :, : nb[r]]
                share = (m - torch.logsumexp(m * 0.693147, -1, keepdim=True) / 0.693147).amax(0)
                assert float(torch.exp2(share[unread]).sum()) * 4.0 <= 1.0 - float(eps[r]) + 1e-4
    torch.testing.assert_close(out["kept_out"], kept, rtol=1e-5, atol=1e-5)
    assert torch.equal(out["probe_out"], out["list_lens_out"])  # probe threshold and caps = the rows' own


def test_selection_reads_the_top_shares_within_one_search_step_of_the_exact_top_p_set():
    """The selected ranked blocks are the highest shares (a prefix of the sorted order); the exact top-p set's last
    share is at most one bisection step above the selection's."""
    cols, bs = 400, 16
    mass = _masses(5, 1, 1, 3, cols, [cols * bs], bs, 3.0)
    sl = torch.tensor([cols * bs], dtype=torch.int32)
    eps = torch.tensor([0.9])
    caps = torch.tensor([[cols]], dtype=torch.int32)
    out = _select(mass, sl, eps, caps, eps, caps[:, 0].contiguous(), block_size=bs)
    n = int(out["list_lens_out"][0, 0])
    got = set(out["lists_out"][0, 0, :n].tolist()) - {0, cols - 1, cols - 2}
    share = out["scores_out"][0, 0].clone()
    share[[0, cols - 1, cols - 2]] = float("-inf")
    order = torch.argsort(share, descending=True).tolist()
    assert got == set(order[: len(got)])
    w = torch.exp2(share[order].double())
    tail = torch.flip(torch.cumsum(torch.flip(w, [0]), 0), [0])
    exact = int((tail > 0.1 / 4.0).sum())  # fewest top blocks whose unread rest <= (1 - eps) / 2^slack
    assert exact <= len(got)
    edge = float(share[order[len(got) - 1]])
    assert float(share[order[exact - 1]]) - edge <= SEARCH_FLOOR / 2 ** SEARCH_STEPS + 1e-6


def test_epsilon_one_selects_every_block_and_probe_counts_its_own_threshold():
    cols, bs = 50, 16
    mass = _masses(9, 2, 1, 2, cols, [cols * bs, 20 * bs], bs)
    sl = torch.tensor([cols * bs, 20 * bs], dtype=torch.int32)
    caps = torch.tensor([[cols], [20]], dtype=torch.int32)
    out = _select(mass, sl, torch.tensor([1.0, 1.0]), caps, torch.tensor([0.9, 1.0]),
                  torch.tensor([cols, 20], dtype=torch.int32), block_size=bs)
    assert out["list_lens_out"].flatten().tolist() == [cols, 20]
    assert out["lists_out"][0, 0, :cols].tolist() == list(range(cols))
    assert out["kept_out"].flatten().tolist() == [1.0, 1.0]
    assert int(out["probe_out"][0, 0]) < cols and int(out["probe_out"][1, 0]) == 20


def _build(pool, cfg, block_size, stat_slots=1):
    nb = -(-pool.req_to_token.shape[1] // block_size)
    table = (paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, nb) if pool.page_size > 1
             else identity_block_table(pool.req_pool_indices, nb))
    hq, d, hk = pool.q.shape[1], pool.q.shape[2], pool.k_buffer.shape[1]
    sp = KeySketchPool(1, int(table.max()) + 1, hk, d, block_size)
    zero = torch.zeros(pool.q.shape[0], dtype=torch.int32)
    sp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens - 1, nb)
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=block_size,
                         max_batch_size=pool.q.shape[0] + 1, max_blocks_per_req=nb, device="cpu",
                         out_dtype=pool.q.dtype, stat_slots=stat_slots)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    w.update_meta_decode(pool.k_buffer, *sp.layer(0))
    return w, sp


@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (32, 8, 128, torch.bfloat16, 16, 16),
    (9, 3, 64, torch.float16, 1, 16),
    (9, 3, 64, torch.bfloat16, 32, 32),
    (4, 4, 64, torch.float16, 16, 16),
])
def test_select_wrapper_equals_exact_attention_over_its_lists_and_the_reference_pipeline(hq, hk, d, dtype, page_size,
                                                                                          block_size):
    cfg = PsaDecodeConfig(epsilon=0.9, sink_blocks=1, local_blocks=1, **SELECT)
    seq_lens = [23 * block_size + 7, 2 * block_size, 9 * block_size + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=11, planted=True)
    w, sp = _build(pool, cfg, block_size)
    assert w.waves == []
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    args = (pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens)
    ro, rlse, rnread, rorder, rkept = psa_decode_reference(*args, cfg, block_size=block_size, sm_scale=pool.sm_scale,
                                                           return_kept_est=True)
    assert torch.equal(nread, rnread)
    for r in range(len(seq_lens)):
        for h in range(hk):
            n = int(nread[r, h])
            assert w.order[r, h, :n].tolist() == rorder[r, h, :n].tolist()
    n_blocks = torch.tensor([-(-n // block_size) for n in seq_lens])
    assert bool((nread < n_blocks[:, None]).any())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.kept_est, rkept, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("epsilon", [0.8, 0.95])
def test_select_keeps_epsilon_of_the_true_mass_on_planted_structure(epsilon):
    cfg = PsaDecodeConfig(epsilon=epsilon, sink_blocks=1, local_blocks=1, **SELECT)
    seq_lens = [40 * 16 + 3, 25 * 16]
    pool = make_pool(seq_lens, 8, 2, 64, torch.bfloat16, 16, seed=21, planted=True)
    w, sp = _build(pool, cfg, 16)
    _, _, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    kept = kept_mass_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
                               w.order, nread, block_size=16, sm_scale=pool.sm_scale)
    assert float(kept.min()) >= epsilon
    assert int(nread.sum()) < (41 + 25) * 2


def test_select_at_epsilon_one_equals_dense():
    cfg = PsaDecodeConfig(epsilon=1.0, **SELECT)
    pool = make_pool([5 * 16 + 2, 3 * 16], 9, 3, 64, torch.float16, 1, seed=4)
    w, sp = _build(pool, cfg, 16)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    ro, rlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    torch.testing.assert_close(o.float(), ro, rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
    assert nread.tolist() == [[6] * 3, [3] * 3]


def test_select_schedule_needs_the_sketch_estimator():
    with pytest.raises(ValueError, match="schedule='select' needs estimator='sketch'"):
        PsaDecodeConfig(schedule="select")
    with pytest.raises(ValueError, match="schedule"):
        PsaDecodeConfig(schedule="waves", criticality="sketch", estimator="sketch")
