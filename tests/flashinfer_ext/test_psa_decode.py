"""Contract: PsaDecodeWrapper (plan/run) = the fp32 PSA reference; epsilon = 1 is dense; kept mass >= epsilon."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.psa.block_meta import BlockMetaPool, identity_block_table, paged_block_table
from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.decode import PsaDecodeWrapper
from flashinfer_ext.common.reference import (criticality_reference, dense_decode_reference, kept_mass_reference,
                                      progressive_decode_reference)

from .kv_pool import make_pool


def build(pool, cfg, block_size, *, max_batch_size=None, meta_dtype=torch.float32, epsilon=None, probe_epsilon=None,
          **wkw):
    """Metadata written by prefill of ``seq_len - 1`` tokens + one decode update through the wrapper."""
    hq, d = pool.q.shape[1], pool.q.shape[2]
    hk = pool.k_buffer.shape[1]
    batch = pool.q.shape[0]
    nb = -(-pool.req_to_token.shape[1] // block_size)
    if pool.page_size > 1:
        table = paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, nb)
    else:
        table = identity_block_table(pool.req_pool_indices, nb)
    mp = BlockMetaPool(1, int(table.max()) + 1, hk, d, block_size, dtype=meta_dtype)
    zero = torch.zeros(batch, dtype=torch.int32)
    mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens - 1, nb)
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=block_size,
                         max_batch_size=max_batch_size or batch, max_blocks_per_req=nb, device="cpu",
                         out_dtype=pool.q.dtype, **wkw)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table, epsilon=epsilon, probe_epsilon=probe_epsilon)
    w.update_meta_decode(pool.k_buffer, *mp.layer(0))
    return w, mp, table


def reference_for(w, pool, cfg, block_size, epsilon=None):
    """fp32 reference of the wrapper's last run, on the wrapper's own ranking (same lists, same scores)."""
    eps = [cfg.epsilon] * pool.q.shape[0] if epsilon is None else [float(e) for e in epsilon]
    n_blocks = (pool.seq_lens + block_size - 1) // block_size
    nf = torch.clamp(n_blocks, max=cfg.sink_blocks + cfg.local_blocks).to(torch.int32)
    lens = torch.minimum(n_blocks, nf + cfg.max_blocks)
    lens = torch.where(torch.tensor(eps) >= 1.0, n_blocks, lens).to(torch.int32)
    lens = lens[:, None].expand(-1, w.num_kv_heads).contiguous()
    return progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
        w.order.clone(), lens, nf, block_size=block_size, sm_scale=pool.sm_scale, epsilon=eps,
        micro_batch_blocks=cfg.micro_batch_blocks, chunk_ends=cfg.ranked_chunk_ends(w.max_blocks_per_req),
        estimator=cfg.estimator, sorted_scores=w.sorted_scores.clone(), calib_slack=cfg.calib_slack,
        return_kept_est=True), lens


def _est(estimator: str) -> dict:
    """Config keys of an estimator ('mean' estimates unread blocks from q . mean key: criticality 'mean')."""
    return dict(estimator=estimator, criticality="mean") if estimator == "mean" else dict(estimator=estimator)


@pytest.mark.parametrize("estimator", ["paper", "bound", "calibrated", "mean"])
@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (32, 8, 128, torch.bfloat16, 16, 16),
    (9, 3, 64, torch.float16, 1, 16),
    (9, 3, 64, torch.bfloat16, 32, 32),
])
def test_wrapper_matches_reference_pipeline(hq, hk, d, dtype, page_size, block_size, estimator):
    """Several waves (tiny first wave, growing chunks): same stops, outputs, lse and estimate as the reference
    (the stop test of every estimator runs in flashinfer_ext.psa.wave_merge)."""
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=64,
                          chunk_growth=2, **_est(estimator))
    seq_lens = [13 * block_size + 7, 2 * block_size, 9 * block_size + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=11, planted=True)
    w, mp, table = build(pool, cfg, block_size, max_batch_size=4, wave_programs=2)
    assert len(w.waves) >= 3
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    # ranking: descending in the reference rank scores (cfg.rank_by: q . mean by default), sink/local first
    ref_scores = criticality_reference(pool.q, *mp.layer(0), table, pool.seq_lens, block_size=block_size,
                                       num_blocks=w.max_blocks_per_req, sink_blocks=1, local_blocks=1,
                                       criticality="mean" if cfg.rank_by == "mean" else cfg.criticality)
    ranked = torch.gather(ref_scores, 2, w.order)  # the sort key is the score truncated to bf16
    fin = torch.isfinite(ranked[..., 1:])
    slack = torch.where(fin, ranked[..., 1:].abs() * 2.0 ** -7, torch.zeros_like(ranked[..., 1:])) + 1e-3
    assert bool((ranked[..., :-1] >= ranked[..., 1:] - slack).all())
    (ro, rlse, rnread, rkept), lens = reference_for(w, pool, cfg, block_size)
    assert torch.equal(nread, rnread)
    if estimator != "bound":
        assert bool((nread < lens).any())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.kept_est, rkept, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (4, 1, 64, torch.float16, 1, 1),
    (8, 2, 128, torch.bfloat16, 64, 64),
])
def test_wrapper_block_sizes_one_and_64(hq, hk, d, dtype, page_size, block_size):
    cfg = PsaDecodeConfig(epsilon=0.85, micro_batch_blocks=4, sink_blocks=1, local_blocks=2, chunk_growth=2)
    seq_lens = [3 * block_size + 5, 75 * block_size // 8 + 1] if block_size > 1 else [70, 41]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=15, planted=block_size > 1)
    w, mp, _ = build(pool, cfg, block_size, wave_programs=1)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    (ro, rlse, rnread, rkept), _ = reference_for(w, pool, cfg, block_size)
    assert torch.equal(nread, rnread)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.kept_est, rkept, rtol=1e-4, atol=1e-4)


def test_per_request_epsilon_rows_and_dense_row():
    """epsilon as a [batch] device tensor: each row stops at its own threshold; the eps = 1 row is dense
    (every block, even past max_blocks) with kept_est 1."""
    cfg = PsaDecodeConfig(epsilon=0.5, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=4)
    seq_lens = [230, 260, 199]
    pool = make_pool(seq_lens, 9, 3, 64, torch.bfloat16, 16, seed=16, planted=True)
    eps = torch.tensor([0.9, 1.0, 0.8])
    w, mp, _ = build(pool, cfg, 16, epsilon=eps, wave_programs=3)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    (ro, rlse, rnread, rkept), _ = reference_for(w, pool, cfg, 16, epsilon=eps)
    assert torch.equal(nread, rnread)
    assert nread[1].tolist() == [17] * 3 and bool((nread[0] <= 6).all())
    torch.testing.assert_close(o.float(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.kept_est, rkept, rtol=1e-4, atol=1e-4)
    assert w.kept_est[1].tolist() == [1.0] * 3
    assert torch.equal(w.probe_nread, nread)  # no probe threshold: each row's own
    do, dlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    torch.testing.assert_close(o[1].float(), do[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[1], dlse[1], rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="epsilon"):
        w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
               torch.zeros(3, 17, dtype=torch.int32), epsilon=torch.ones(2))


@pytest.mark.parametrize("estimator", ["calibrated", "paper"])
def test_probe_row_gets_the_exact_result_and_the_reads_of_its_threshold(estimator):
    """probe_epsilon: a row run at epsilon 1.0 with a threshold as probe_epsilon returns the dense result and, in
    probe_nread, exactly the blocks a run at that threshold reads (its max_blocks cap included); a row run at its
    own threshold has probe_nread == nread."""
    cfg = PsaDecodeConfig(epsilon=0.5, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=10,
                          **_est(estimator))
    pool = make_pool([230, 260, 199, 300], 8, 2, 64, torch.float16, 16, seed=23, planted=True)
    eps, probe = torch.tensor([0.9, 1.0, 1.0, 0.8]), torch.tensor([0.9, 0.8, 0.95, 0.8])
    w, mp, _ = build(pool, cfg, 16, epsilon=eps, probe_epsilon=probe, wave_programs=3)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    (ro, rlse, rnread, _), _ = reference_for(w, pool, cfg, 16, epsilon=eps)
    assert torch.equal(nread, rnread)
    (_, _, probe_rnread, _), _ = reference_for(w, pool, cfg, 16, epsilon=probe)
    assert torch.equal(w.probe_nread, probe_rnread)
    assert torch.equal(w.probe_nread[[0, 3]], nread[[0, 3]])
    assert bool((w.probe_nread[1:3] < nread[1:3]).all())  # the probe rows read everything, PSA would not
    do, dlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    torch.testing.assert_close(o[1:3].float(), do[1:3], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[1:3], dlse[1:3], rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="probe_epsilon"):
        w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
               torch.zeros(4, 19, dtype=torch.int32), probe_epsilon=torch.ones(3))


@pytest.mark.parametrize("prefix", [16, 0])
def test_wrapper_partial_ranking_prefix(prefix):
    """sorted_prefix_blocks: the top-16 ranks are the 16 best blocks in order, the rest in block order
    (0 = full sort); the stops still equal the reference on the wrapper's order; eps = 1 rows stay dense."""
    cfg = PsaDecodeConfig(epsilon=0.99, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, estimator="paper",
                          sorted_prefix_blocks=prefix, rank_by="criticality")  # sorted_scores are the rank keys
    pool = make_pool([700, 500], 9, 3, 64, torch.bfloat16, 16, seed=19, planted=True)
    w, mp, _ = build(pool, cfg, 16, epsilon=torch.tensor([0.99, 1.0]))
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    (ro, rlse, rnread, _), _ = reference_for(w, pool, cfg, 16, epsilon=[0.99, 1.0])
    assert torch.equal(nread, rnread) and nread[1].tolist() == [32] * 3
    torch.testing.assert_close(o.float(), ro, rtol=2e-2, atol=2e-2)
    srt = w.sorted_scores
    n_blocks = [44, 32]
    for r in range(2):
        for h in range(3):
            o_rh = w.order[r, h, :n_blocks[r]].tolist()
            assert sorted(o_rh) == list(range(n_blocks[r]))
            if prefix:
                assert o_rh[16:] == sorted(o_rh[16:])
                s = srt[r, h, :16]
                assert bool((s[:-1] >= s[1:] - s[1:].abs().clamp(max=1e30) * 2 ** -7 - 1e-3).all())


def test_wave_layout_does_not_change_the_result():
    """The stop test is chunk by chunk: one wave per chunk or one wave for everything, same answer."""
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, chunk_growth=2)
    pool = make_pool([300, 170], 9, 3, 64, torch.bfloat16, 16, seed=17, planted=True)
    outs = []
    for kw in (dict(wave_programs=1, wave_growth=1.0), dict(wave_programs=1 << 20), dict(wave_programs=6,
                                                                                           wave_growth=4.0)):
        w, mp, _ = build(pool, cfg, 16, **kw)
        o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
        outs.append((len(w.waves), o.clone(), lse.clone(), nread.clone(), w.kept_est.clone()))
    assert outs[0][0] > 4 and outs[1][0] == 1
    for n, o, lse, nread, kept in outs[1:]:
        assert torch.equal(nread, outs[0][3])
        torch.testing.assert_close(o, outs[0][1], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse, outs[0][2], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kept, outs[0][4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 16), (torch.float16, 1)])
def test_epsilon_one_equals_dense(dtype, page_size):
    cfg = PsaDecodeConfig(epsilon=1.0, micro_batch_blocks=4, sink_blocks=1, local_blocks=2)
    seq_lens = [150, 17, 64]
    pool = make_pool(seq_lens, 9, 3, 64, dtype, page_size, seed=12, planted=True)
    w, mp, _ = build(pool, cfg, 16)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    do, dlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    assert nread.tolist() == [[10] * 3, [2] * 3, [4] * 3]
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), do, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, dlse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("estimator", ["paper", "bound", "calibrated", "mean"])
@pytest.mark.parametrize("epsilon", [0.9, 0.95])
def test_true_kept_mass_reaches_epsilon_on_planted_structure(epsilon, estimator):
    """For >= 99 % of (request, query head) pairs the mass of the blocks read is >= epsilon; the paper
    and calibrated estimators save reads (mean blocks read < 60 % of all blocks)."""
    cfg = PsaDecodeConfig(epsilon=epsilon, micro_batch_blocks=2, sink_blocks=1, local_blocks=1,
                          **_est(estimator))
    seq_lens = [700, 513, 960, 800]
    pool = make_pool(seq_lens, 9, 3, 64, torch.bfloat16, 16, seed=13, planted=True)
    w, mp, _ = build(pool, cfg, 16)
    _, _, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    kept = kept_mass_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
                               w.order, nread, block_size=16, sm_scale=pool.sm_scale)
    frac_ok = (kept >= epsilon).float().mean().item()
    n_blocks = ((pool.seq_lens + 15) // 16).float()
    read_frac = (nread.float() / n_blocks[:, None]).mean().item()
    assert frac_ok >= 0.99, f"kept >= eps for only {frac_ok:.3f} of pairs (min kept {kept.min():.4f})"
    if estimator != "bound":
        assert read_frac < 0.6, f"read {read_frac:.2f} of all blocks: no sparsity"


@pytest.mark.parametrize("planted", [False, True])
def test_bound_estimator_is_a_guarantee(planted):
    """'bound': the estimate never exceeds the true kept mass (min over the group), so kept >= eps always."""
    eps = 0.8
    cfg = PsaDecodeConfig(epsilon=eps, micro_batch_blocks=1, sink_blocks=1, local_blocks=1, estimator="bound")
    pool = make_pool([400, 333, 96], 9, 3, 64, torch.bfloat16, 16, seed=18, planted=planted)
    w, mp, _ = build(pool, cfg, 16)
    _, _, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    kept = kept_mass_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
                               w.order, nread, block_size=16, sm_scale=pool.sm_scale)
    kept_kv = kept.view(3, 3, 3).amin(-1)
    assert bool((kept >= eps - 1e-4).all())
    assert bool((w.kept_est <= kept_kv + 1e-3).all()), (w.kept_est, kept_kv)


def test_config_rejects_bad_values_naming_the_field():
    for kw, field in ((dict(epsilon=0.0), "epsilon"), (dict(epsilon=1.5), "epsilon"),
                      (dict(micro_batch_blocks=3), "micro_batch_blocks"), (dict(sink_blocks=-1), "sink_blocks"),
                      (dict(max_blocks=0), "max_blocks"), (dict(criticality="quest"), "criticality"),
                      (dict(group_reduce="mean"), "group_reduce"), (dict(local_blocks=True), "local_blocks"),
                      (dict(calib_slack=-1.0), "calib_slack"), (dict(chunk_growth=1), "chunk_growth"),
                      (dict(max_chunk_blocks=4), "max_chunk_blocks"), (dict(max_chunk_blocks=24), "max_chunk_blocks"),
                      (dict(sorted_prefix_blocks=8), "sorted_prefix_blocks"),
                      (dict(sorted_prefix_blocks=100), "sorted_prefix_blocks"),
                      (dict(estimator="bound", group_reduce="sum"), "estimator"),
                      (dict(estimator="calibrated", criticality="mean"), "estimator"),
                      (dict(estimator="mean"), "estimator"), (dict(estimator="mean", criticality="mean",
                                                                  group_reduce="sum"), "estimator")):
        with pytest.raises(ValueError, match=field):
            PsaDecodeConfig(**kw)
    with pytest.raises(ValueError, match=r"PsaDecodeConfig\.estimator='oracle'.*'paper', 'bound', 'calibrated', 'mean'"):
        PsaDecodeConfig(estimator="oracle")
    assert PsaDecodeConfig(epsilon=1).epsilon == 1.0
    assert PsaDecodeConfig().estimator == "calibrated"
    assert PsaDecodeConfig(estimator="paper", group_reduce="sum").group_reduce == "sum"
    assert PsaDecodeConfig(sorted_prefix_blocks=16, sink_blocks=10, local_blocks=10).ranking_prefix() == 32
    assert PsaDecodeConfig(sorted_prefix_blocks=0).ranking_prefix() == 0


def test_ranked_chunk_schedule():
    cfg = PsaDecodeConfig(micro_batch_blocks=8, chunk_growth=16, max_chunk_blocks=256)
    ends = cfg.ranked_chunk_ends(100_000)
    sizes = [b - a for a, b in zip([0] + ends, ends)]
    assert ends[:3] == [8, 16, 24] and ends[-1] >= 100_000
    assert all(s in (8, 16, 32, 64, 128, 256) for s in sizes) and max(sizes) == 256
    assert all(s <= max(8, e // 16) for s, e in zip(sizes, [0] + ends))  # overshoot <= 1/16 of the reads
    assert cfg.ranked_chunk_ends(50) == ends[: len(cfg.ranked_chunk_ends(50))]  # prefix-stable
    assert PsaDecodeConfig(micro_batch_blocks=4, chunk_growth=0).ranked_chunk_ends(10) == [4, 8, 12]


def test_plan_rejects_batch_above_capacity():
    pool = make_pool([40, 40], 9, 3, 64, torch.bfloat16, 16, seed=14)
    w = PsaDecodeWrapper(PsaDecodeConfig(), num_qo_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                         max_batch_size=1, max_blocks_per_req=4, device="cpu")
    with pytest.raises(ValueError, match="max_batch_size"):
        w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, torch.zeros(2, 4, dtype=torch.int32))


def test_user_config_maps_the_mean_estimator_onto_mean_scores():
    """``{"estimator": "mean"}`` in --sparse-config: the kernel estimates unread blocks from q . mean key."""
    from sglang_sparse.config import PsaConfig
    from sglang_sparse.psa.runner import kernel_config

    k = kernel_config(PsaConfig.from_dict({"estimator": "mean"}))
    assert (k.estimator, k.criticality, k.group_reduce, k.rank_by) == ("mean", "mean", "max", "mean")
    k = kernel_config(PsaConfig())
    assert (k.estimator, k.criticality) == ("calibrated", "cuboid")


def test_stage_cut_runs_leave_the_full_run_unchanged():
    """``run(stop_after=...)`` (the benchmark's stage profile) stops after each stage and never disturbs the next
    full run: its outputs equal a fresh wrapper's; an unknown stage is refused before any kernel runs."""
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=4, sink_blocks=1, local_blocks=2)
    pool = make_pool([300, 170], 8, 2, 64, torch.bfloat16, 16, seed=31, planted=True)
    w, mp, _ = build(pool, cfg, 16, wave_programs=2)
    args = (pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    o0, lse0, n0 = (t.clone() for t in w.run(*args))
    for st in PsaDecodeWrapper.STAGES:
        w.run(*args, stop_after=st)
    o1, lse1, n1 = w.run(*args)
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1) and torch.equal(n0, n1)
    with pytest.raises(ValueError, match="stop_after='merge'"):
        w.run(*args, stop_after="merge")
