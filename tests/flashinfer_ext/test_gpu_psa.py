"""GPU contracts (marker ``gpu``; skipped without CUDA): compiled Triton kernels (criticality, sort,
bound suffix, waves of chunk attention + merge) = fp32 reference for every estimator, epsilon = 1
(config or per-request row) = FlashInfer dense decode, base-2 merge convention, CUDA-graph capture
and replay with plan() between replays, kept mass on the benchmark's planted structure."""

from __future__ import annotations

import pytest
import torch

from .kv_pool import make_pool
from .test_criticality import check_rank_order

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _wrapper(pool, cfg, block_size, max_batch_size=None, epsilon=None, probe_epsilon=None, layout=None, **wkw):
    from flashinfer_ext.psa.block_meta import BlockMetaPool, paged_block_table
    from flashinfer_ext.psa.decode import PsaDecodeWrapper

    hq, d = pool.q.shape[1], pool.q.shape[2]
    hk, batch = pool.k_buffer.shape[1], pool.q.shape[0]
    nb = -(-pool.req_to_token.shape[1] // block_size)
    table = paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, nb)
    mp = BlockMetaPool(1, pool.k_buffer.shape[0] // pool.page_size, hk, d, block_size, dtype=pool.k_buffer.dtype,
                       device="cuda", layout=layout or PsaDecodeWrapper.META_LAYOUT)
    zero = torch.zeros(batch, dtype=torch.int32, device="cuda")
    mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, nb)
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=block_size,
                         max_batch_size=max_batch_size or batch, max_blocks_per_req=nb, device="cuda",
                         out_dtype=pool.q.dtype, **wkw)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table, epsilon=epsilon, probe_epsilon=probe_epsilon)
    return w, mp, table


def _check_against_reference(w, pool, cfg, o, lse, nread, block_size, epsilon=None):
    from flashinfer_ext.common.reference import progressive_decode_reference

    batch = pool.q.shape[0]
    eps = [cfg.epsilon] * batch if epsilon is None else epsilon.cpu().tolist()
    n_blocks = ((pool.seq_lens + block_size - 1) // block_size).cpu()
    nf = torch.clamp(n_blocks, max=cfg.sink_blocks + cfg.local_blocks).to(torch.int32)
    lens = torch.minimum(n_blocks, nf + cfg.max_blocks)
    lens = torch.where(torch.tensor(eps) >= 1.0, n_blocks, lens).to(torch.int32)[:, None].expand(-1, w.num_kv_heads)
    ro, rlse, rnread, rkept = progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
        w.order.cpu(), lens.contiguous(), nf, block_size=block_size, sm_scale=pool.sm_scale,
        epsilon=eps, micro_batch_blocks=cfg.micro_batch_blocks,
        chunk_ends=cfg.ranked_chunk_ends(w.max_blocks_per_req), estimator=cfg.estimator,
        sorted_scores=w.sorted_scores.cpu(), calib_slack=cfg.calib_slack, return_kept_est=True)
    same = (nread.cpu() == rnread)  # fp32 summation order may flip a stop decision at the threshold edge
    assert same.float().mean().item() >= 0.98, f"stop decisions differ on {(~same).sum()} pairs"
    group = pool.q.shape[1] // w.num_kv_heads
    mask = same.repeat_interleave(group, dim=1)
    tol = 2e-2 if pool.q.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float().cpu()[mask], ro[mask], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu()[mask], rlse[mask], rtol=1e-4, atol=2e-3)
    torch.testing.assert_close(w.kept_est.cpu()[same], rkept[same], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("hq,hk,d,dtype,page", [(32, 8, 128, torch.bfloat16, 16), (9, 3, 64, torch.float16, 32),
                                                (32, 8, 128, torch.float16, 64), (32, 8, 128, torch.bfloat16, 1)])
@pytest.mark.parametrize("epsilon,estimator", [(1.0, "calibrated"), (0.9, "paper"), (0.9, "calibrated"),
                                               (0.9, "bound"), (0.9, "mean")])
def test_gpu_wrapper_matches_reference(hq, hk, d, dtype, page, epsilon, estimator):
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=epsilon, micro_batch_blocks=4, sink_blocks=1, local_blocks=2, estimator=estimator,
                          criticality="mean" if estimator == "mean" else "cuboid")
    pool = make_pool([2000, 37, 1500 + page // 2, 800], hq, hk, d, dtype, page, seed=21, device="cuda",
                     planted=True)
    w, mp, _ = _wrapper(pool, cfg, page, wave_programs=8, wave_growth=2.0, max_waves=12)  # several waves
    assert len(w.waves) >= 3
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    torch.cuda.synchronize()
    _check_against_reference(w, pool, cfg, o, lse, nread, page)


def _crit_grid():
    from bench.psa_plans import CRIT_SWEEP_GRID

    return CRIT_SWEEP_GRID


@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("layout_tile", _crit_grid(), ids=lambda lt: f"{lt[0]}-b{lt[1].tile_b}-h{lt[1].heads}-"
                         f"e{lt[1].elements}-w{lt[1].num_warps}")
def test_gpu_every_swept_launch_shape_and_layout_matches_reference(layout_tile, hq, hk, d):
    """Every (metadata layout, criticality launch shape) the benchmark sweeps gives the reference's decode."""
    from flashinfer_ext.psa.config import PsaDecodeConfig

    layout, tile = layout_tile
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=4, sink_blocks=1, local_blocks=2)
    pool = make_pool([2000, 37, 1508, 800], hq, hk, d, torch.bfloat16, 16, seed=22, device="cuda", planted=True)
    w, mp, _ = _wrapper(pool, cfg, 16, layout=layout, crit_tile=tile)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    torch.cuda.synchronize()
    _check_against_reference(w, pool, cfg, o, lse, nread, 16)


def test_gpu_per_request_epsilon_rows():
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=0.95, micro_batch_blocks=4, max_blocks=8)
    pool = make_pool([3000, 1200, 2500], 32, 8, 128, torch.bfloat16, 16, seed=25, device="cuda", planted=True)
    eps = torch.tensor([0.9, 1.0, 0.7], device="cuda")
    w, mp, _ = _wrapper(pool, cfg, 16, epsilon=eps)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    torch.cuda.synchronize()
    assert nread[1].tolist() == [75] * 8 and w.kept_est[1].tolist() == [1.0] * 8
    _check_against_reference(w, pool, cfg, o, lse, nread, 16, epsilon=eps)


def test_gpu_probe_rows_read_everything_and_report_the_reads_of_their_threshold():
    """Compiled merge with a probe threshold: rows run at epsilon 1.0 with probe_epsilon 0.9 / 0.7 read every block
    (the dense result) and report in probe_nread the reference's stop at that threshold (max_blocks cap included);
    the row run at its own threshold has probe_nread == nread."""
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=0.95, micro_batch_blocks=4, max_blocks=40)
    pool = make_pool([3000, 1200, 2500], 32, 8, 128, torch.bfloat16, 16, seed=25, device="cuda", planted=True)
    eps = torch.tensor([1.0, 0.9, 1.0], device="cuda")
    probe = torch.tensor([0.9, 0.9, 0.7], device="cuda")
    w, mp, _ = _wrapper(pool, cfg, 16, epsilon=eps, probe_epsilon=probe, wave_programs=8)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    torch.cuda.synchronize()
    assert nread[0].tolist() == [188] * 8 and nread[2].tolist() == [157] * 8  # every block
    assert torch.equal(w.probe_nread[1], nread[1])
    _check_against_reference(w, pool, cfg, o, lse, nread, 16, epsilon=eps)
    pw, pmp, _ = _wrapper(pool, cfg, 16, epsilon=probe, wave_programs=8)  # the same rows run at the probe thresholds
    _, _, probe_nread = pw.run(pool.q, pool.k_buffer, pool.v_buffer, *pmp.layer(0))
    torch.cuda.synchronize()
    same = (w.probe_nread == probe_nread)
    assert same.float().mean().item() >= 0.95, (w.probe_nread, probe_nread)
    assert bool((w.probe_nread[[0, 2]] < nread[[0, 2]]).all())


@pytest.mark.parametrize("page", [16, 1])
def test_gpu_epsilon_one_equals_flashinfer_dense(page):
    pytest.importorskip("flashinfer")
    from flashinfer_ext.psa.block_meta import BlockMetaPool, identity_block_table
    from flashinfer_ext.psa.config import PsaDecodeConfig
    from flashinfer_ext.common.dense_decode import FlashInferDenseDecode, paged_kv_table
    from flashinfer_ext.psa.decode import PsaDecodeWrapper

    seq = [3000, 77, 1234]
    pool = make_pool(seq, 32, 8, 128, torch.bfloat16, page, seed=22, device="cuda")
    block = 16
    nb = -(-pool.req_to_token.shape[1] // block)
    table = identity_block_table(pool.req_pool_indices, nb)
    mp = BlockMetaPool(1, int(table.max()) + 1, 8, 128, block, dtype=torch.bfloat16, device="cuda")
    zero = torch.zeros(3, dtype=torch.int32, device="cuda")
    mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, nb)
    w = PsaDecodeWrapper(PsaDecodeConfig(epsilon=0.5), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         block_size=block, max_batch_size=3, max_blocks_per_req=nb, device="cuda")
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table,
           epsilon=torch.ones(3, device="cuda"))  # per-request rows at 1.0 = dense
    o, lse, _ = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    dense = FlashInferDenseDecode(32, 8, 128, page)
    dense.plan(*paged_kv_table(pool.req_to_token, pool.req_pool_indices.tolist(), seq, page))
    do, dlse = dense.run(pool.q, pool.k_buffer, pool.v_buffer)
    torch.testing.assert_close(o.float(), do.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, dlse.float(), rtol=1e-3, atol=2e-2)


def test_gpu_flashinfer_merge_state_is_base2_like_reference():
    pytest.importorskip("flashinfer")
    from flashinfer_ext.common.merge import merge_state
    from flashinfer_ext.common.reference import merge_states_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    va, vb = (torch.randn(5, 8, 128, device="cuda", generator=g).half() for _ in range(2))
    sa, sb = (torch.randn(5, 8, device="cuda", generator=g) * 4 for _ in range(2))
    v, s = merge_state(va, sa, vb, sb)
    rv, rs = merge_states_reference(va, sa, vb, sb)
    torch.testing.assert_close(v.float(), rv, rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(s.float(), rs, rtol=1e-4, atol=1e-4)


def test_gpu_cuda_graph_capture_and_replay_matches_eager():
    """Capture update_meta_decode + run once; re-plan (device tensors: new lengths, new per-request
    epsilon) in place between replays; replay = eager, bit for bit, and = the reference."""
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=4)
    pool = make_pool([1500, 900, 2100, 64], 32, 8, 128, torch.bfloat16, 16, seed=23, device="cuda",
                     planted=True, max_context_len=2400)
    eps = torch.tensor([0.9, 0.95, 1.0, 0.8], device="cuda")
    w, mp, table = _wrapper(pool, cfg, 16, epsilon=eps, wave_programs=16)
    n_launch_waves = len(w.waves)
    static_q = pool.q.clone()
    meta = mp.layer(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            w.update_meta_decode(pool.k_buffer, *meta)
            w.run(static_q, pool.k_buffer, pool.v_buffer, *meta)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.update_meta_decode(pool.k_buffer, *meta)
        g_o, g_lse, g_nread = w.run(static_q, pool.k_buffer, pool.v_buffer, *meta)
    for step in range(3):  # next decode steps: more tokens (different per request), new queries and thresholds
        pool.seq_lens += torch.tensor([1, 7, 1, 40], dtype=torch.int32, device="cuda")
        pool.q = torch.randn_like(pool.q.float()).to(pool.q.dtype)
        static_q.copy_(pool.q)
        eps = eps.roll(1)
        mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table,
                  torch.zeros_like(pool.seq_lens), pool.seq_lens - 1, -(-2400 // 16))  # prefill of the new tokens
        w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table, epsilon=eps)
        assert len(w.waves) == n_launch_waves
        graph.replay()
        torch.cuda.synchronize()
        got = (g_o.clone(), g_lse.clone(), g_nread.clone(), w.kept_est.clone())
        e_o, e_lse, e_nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *meta)
        torch.cuda.synchronize()
        assert torch.equal(got[2], e_nread)
        torch.testing.assert_close(got[0], e_o, rtol=0, atol=0)
        torch.testing.assert_close(got[1], e_lse, rtol=0, atol=0)
        torch.testing.assert_close(got[3], w.kept_est, rtol=0, atol=0)
        _check_against_reference(w, pool, cfg, e_o, e_lse, e_nread, 16, epsilon=eps)


@pytest.mark.parametrize("cols,prefix", [(8192, 1024), (3000, 256), (100, 128)])
def test_gpu_rank_select_sorts_the_prefix_by_key_then_higher_block(cols, prefix):
    """Compiled rank_select (candidates sorted packed as int32) over keys spanning int16, with and without padding:
    the top-``prefix`` keys in descending order, ties by the higher block id, the rest in block order."""
    from flashinfer_ext.psa.rank_select import rank_select

    g = torch.Generator(device="cuda").manual_seed(cols)
    k = torch.randint(-32768, 32767, (4, 8, cols), dtype=torch.int16, device="cuda", generator=g)
    k[..., :2] = 32767
    k[..., 5] = -32768
    o = torch.empty(4, 8, cols, dtype=torch.int64, device="cuda")
    rank_select(k, o, torch.empty(32 * prefix, dtype=torch.int32, device="cuda"), prefix=prefix)
    check_rank_order(o, k, prefix)


@pytest.mark.parametrize("estimator", ["calibrated", "paper"])
def test_gpu_kept_mass_on_benchmark_planted_structure_32k(estimator):
    """The benchmark's planted workload (bench.psa_decode_bench.PLANT) at 32k: >= 99 % of (request, qo head)
    pairs keep >= eps of the true mass, reading < 15 % of the blocks (CPU torch simulation of the
    same algorithm: calibrated 5 %, paper 6.6 % at 32k, batch 1)."""
    from bench.psa_decode_bench import build_pool, kept_mass
    from flashinfer_ext.psa.block_meta import BlockMetaPool, paged_block_table
    from flashinfer_ext.psa.config import PsaDecodeConfig
    from flashinfer_ext.psa.decode import PsaDecodeWrapper

    eps, ctx, page = 0.95, 32768, 16
    q, k, v, rtt, rpi = build_pool(4, ctx, 32, 8, 128, page, True, seed=24)
    seq = torch.full((4,), ctx, dtype=torch.int32, device="cuda")
    nb = ctx // page
    table = paged_block_table(rtt, rpi, page, nb)
    mp = BlockMetaPool(1, k.shape[0] // page, 8, 128, page, dtype=torch.bfloat16, device="cuda")
    mp.update(0, k, rtt, rpi, table, torch.zeros_like(seq), seq, nb)
    cfg = PsaDecodeConfig(epsilon=eps, estimator=estimator)
    w = PsaDecodeWrapper(cfg, num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=page, max_batch_size=4,
                         max_blocks_per_req=nb, device="cuda")
    w.plan(rtt, rpi, seq, table)
    _, _, nread = w.run(q, k, v, *mp.layer(0))
    kept, _ = kept_mass(q, k, rtt, rpi, [ctx] * 4, w.order, nread, page, 128 ** -0.5)
    assert (kept >= eps).float().mean().item() >= 0.99, f"min kept {kept.min():.4f}"
    assert (nread.float() / nb).mean().item() < 0.15
