"""Contract: PSA's int4 key sketch (flashinfer_ext.psa.key_sketch) = its fp32 reference — the quantized keys written
through a block table, the per-head block masses, the group-max shares and totals — and the wrapper run with the
'sketch' criticality / estimator stops where the reference stop test does, on the wrapper's own ranking."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.reference import dense_decode_reference, kept_mass_reference, progressive_decode_reference
from flashinfer_ext.psa.block_meta import identity_block_table, paged_block_table
from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.decode import PsaDecodeWrapper
from flashinfer_ext.psa.key_sketch import (KeySketchPool, quantize_keys_reference, sketch_block_mass, sketch_shares,
                                           sketch_scores_reference)

from .kv_pool import make_pool

SKETCH = dict(criticality="sketch", estimator="sketch")


def _table(pool, block_size):
    nb = -(-pool.req_to_token.shape[1] // block_size)
    if pool.page_size > 1:
        return paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, nb), nb
    return identity_block_table(pool.req_pool_indices, nb), nb


def _sketch_pool(pool, block_size, end=None):
    table, nb = _table(pool, block_size)
    hk, d = pool.k_buffer.shape[1], pool.k_buffer.shape[2]
    sp = KeySketchPool(1, int(table.max()) + 1, hk, d, block_size)
    zero = torch.zeros(pool.q.shape[0], dtype=torch.int32)
    sp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero,
              pool.seq_lens if end is None else end, nb)
    return sp, table, nb


def _unpack(codes):
    half = codes.shape[-1]
    c = codes.to(torch.int32)
    return torch.cat([(c & 15) - 8, (c >> 4) - 8], -1)[..., : 2 * half]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size,block_size,d", [(1, 16, 64), (16, 16, 128), (32, 32, 64)])
def test_written_sketch_equals_quantized_keys(dtype, page_size, block_size, d):
    """Every position of every request (partial last blocks included) holds the reference's int4 codes and fp16
    scale, written in two ranges (a prefill, then one decode token) as the server does."""
    seq_lens = [3 * block_size + 5, block_size, 2 * block_size + 1]
    pool = make_pool(seq_lens, 6, 2, d, dtype, page_size, seed=3)
    sp, table, nb = _sketch_pool(pool, block_size, end=pool.seq_lens - 1)
    sp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, pool.seq_lens - 1, pool.seq_lens, 1)
    codes, scales = sp.layer(0)
    for r, n in enumerate(seq_lens):
        slots = pool.req_to_token[int(pool.req_pool_indices[r]), :n].long()
        rc, rs = quantize_keys_reference(pool.k_buffer[slots])  # [n, H, d], [n, H]
        for pos in range(n):
            row, t = int(table[r, pos // block_size]), pos % block_size
            assert torch.equal(_unpack(codes[row, :, t]), rc[pos].to(torch.int32)), (r, pos)
            assert torch.equal(scales[row, :, t], rs[pos]), (r, pos)


@pytest.mark.parametrize("hq,hk,d,page_size,block_size", [(9, 3, 64, 1, 16), (32, 8, 128, 16, 16),
                                                          (4, 4, 64, 32, 32)])
def test_block_masses_shares_and_totals_match_reference(hq, hk, d, page_size, block_size):
    seq_lens = [7 * block_size + 3, 2 * block_size, 4 * block_size + 9]
    pool = make_pool(seq_lens, hq, hk, d, torch.bfloat16, page_size, seed=5, planted=True)
    sp, table, nb = _sketch_pool(pool, block_size)
    batch, g = len(seq_lens), hq // hk
    mass = torch.empty(batch, hk, g, nb)
    sketch_block_mass(pool.q, *sp.layer(0), table, pool.seq_lens, mass, block_size=block_size,
                      sm_scale=pool.sm_scale, tile_b=2)
    scores, keys, tot = torch.empty(batch, hk, nb), torch.empty(batch, hk, nb, dtype=torch.int16), torch.empty(
        batch * hk * g)
    sketch_shares(mass, pool.seq_lens, scores, tot, block_size=block_size, sink_blocks=1, local_blocks=2,
                  keys_out=keys, tile=16)
    r_scores, r_tot, r_mass = sketch_scores_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                                      pool.seq_lens, block_size=block_size, sm_scale=pool.sm_scale,
                                                      num_blocks=nb, sink_blocks=1, local_blocks=2)
    torch.testing.assert_close(mass, r_mass, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(tot.view(batch, hq), r_tot, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(scores, r_scores, rtol=1e-4, atol=1e-3)
    # the int16 keys order like the scores (bf16 truncation: equal keys only within a bf16 step)
    fin = torch.isfinite(scores)
    a, b = scores[fin], keys[fin].to(torch.int32)
    i, j = torch.triu_indices(a.numel(), a.numel(), 1)
    bigger = a[i] > a[j] + a[i].abs() * 2 ** -7 + 1e-6
    assert bool((b[i][bigger] >= b[j][bigger]).all())


@pytest.mark.parametrize("block_size,page_size,hq,hk,d,dtype,tile_b,sub_tokens", [
    (1, 1, 3, 1, 64, torch.bfloat16, 0, 0),  # one token per block, the whole request in one program
    (16, 16, 9, 3, 64, torch.float16, 0, 0),  # default tile (128 blocks) past every request's end
    (16, 1, 8, 2, 16, torch.bfloat16, 16, 64),  # small head_dim, group 4, four sub-tiles per program
    (32, 32, 2, 2, 16, torch.float16, 4, 0),  # group 1, block 32, several programs per request
    (32, 1, 8, 2, 64, torch.bfloat16, 2, 0),  # group 4, tile_b rounded up to 16 dot columns
    (16, 1, 6, 2, 12, torch.float16, 8, 0),  # head_dim / 2 not a multiple of 4: codes read as bytes
    (16, 1, 32, 1, 64, torch.bfloat16, 0, 0),  # group 32: no token folding
])
def test_block_mass_matches_reference_over_shapes(block_size, page_size, hq, hk, d, dtype, tile_b, sub_tokens):
    """Tensor-core block masses = the fp32 reference for block sizes 1..32, groups 1..32, small and odd head dims,
    bf16 / fp16 queries, partial last blocks, one-token requests, tiles longer or shorter than the requests."""
    seq_lens = [5 * block_size + 3, block_size, 2 * block_size + 1, 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=9, planted=True)
    sp, table, nb = _sketch_pool(pool, block_size)
    mass = torch.full((len(seq_lens), hk, hq // hk, nb), 123.0)
    sketch_block_mass(pool.q, *sp.layer(0), table, pool.seq_lens, mass, block_size=block_size,
                      sm_scale=pool.sm_scale, tile_b=tile_b, sub_tokens=sub_tokens)
    _, _, r_mass = sketch_scores_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                           pool.seq_lens, block_size=block_size, sm_scale=pool.sm_scale,
                                           num_blocks=nb, sink_blocks=1, local_blocks=1)
    assert torch.equal(torch.isinf(mass), torch.isinf(r_mass))  # -inf exactly past each request's end
    torch.testing.assert_close(mass, r_mass, rtol=1e-4, atol=1e-3)


def _build(pool, cfg, block_size, **wkw):
    sp, table, nb = _sketch_pool(pool, block_size, end=pool.seq_lens - 1)
    hq, d, hk = pool.q.shape[1], pool.q.shape[2], pool.k_buffer.shape[1]
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=block_size,
                         max_batch_size=pool.q.shape[0] + 1, max_blocks_per_req=nb, device="cpu",
                         out_dtype=pool.q.dtype, **wkw)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    w.update_meta_decode(pool.k_buffer, *sp.layer(0))  # the decode token's key folded by the wrapper
    return w, sp


@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (32, 8, 128, torch.bfloat16, 16, 16),
    (9, 3, 64, torch.float16, 1, 16),
    (9, 3, 64, torch.bfloat16, 32, 32),
])
def test_sketch_wrapper_matches_reference_stop_test(hq, hk, d, dtype, page_size, block_size):
    """Several waves: the same stops, outputs, lse and kept estimate as the fp32 reference stop test on the
    wrapper's ranking, shares and totals; fewer blocks than the list on planted structure."""
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=64,
                          chunk_growth=2, **SKETCH)
    seq_lens = [13 * block_size + 7, 2 * block_size, 9 * block_size + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=11, planted=True)
    w, sp = _build(pool, cfg, block_size, wave_programs=2)
    assert len(w.waves) >= 3
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    batch = len(seq_lens)
    r_scores, r_tot, _ = sketch_scores_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                                 pool.seq_lens, block_size=block_size, sm_scale=pool.sm_scale,
                                                 num_blocks=w.max_blocks_per_req, sink_blocks=1, local_blocks=1)
    n_blocks = (pool.seq_lens + block_size - 1) // block_size
    nf = torch.clamp(n_blocks, max=2).to(torch.int32)
    lens = torch.minimum(n_blocks, nf + cfg.max_blocks).to(torch.int32)[:, None].expand(-1, hk).contiguous()
    ro, rlse, rnread, rkept = progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
        w.order.clone(), lens, nf, block_size=block_size, sm_scale=pool.sm_scale, epsilon=[0.9] * batch,
        micro_batch_blocks=2, chunk_ends=cfg.ranked_chunk_ends(w.max_blocks_per_req), estimator="sketch",
        sorted_scores=torch.gather(r_scores, 2, w.order), calib_slack=cfg.calib_slack, return_kept_est=True,
        sketch_totals=r_tot)
    assert torch.equal(nread, rnread)
    assert bool((nread < lens).any())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.kept_est, rkept, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("epsilon", [0.8, 0.95])
def test_sketch_keeps_epsilon_of_the_true_mass_on_planted_structure(epsilon):
    """The stop test's estimate comes from every key: the true kept mass of each query head reaches epsilon."""
    cfg = PsaDecodeConfig(epsilon=epsilon, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, chunk_growth=0,
                          **SKETCH)
    seq_lens = [40 * 16 + 3, 25 * 16]
    pool = make_pool(seq_lens, 8, 2, 64, torch.bfloat16, 16, seed=21, planted=True)
    w, sp = _build(pool, cfg, 16)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    kept = kept_mass_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
                               w.order, nread, block_size=16, sm_scale=pool.sm_scale)
    assert float(kept.min()) >= epsilon
    assert int(nread.sum()) < int(((pool.seq_lens + 15) // 16).sum()) * 2  # fewer than every block


def test_sketch_at_epsilon_one_equals_dense():
    cfg = PsaDecodeConfig(epsilon=1.0, **SKETCH)
    pool = make_pool([5 * 16 + 2, 3 * 16], 9, 3, 64, torch.float16, 1, seed=4)
    w, sp = _build(pool, cfg, 16)
    o, lse, _ = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    ro, rlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    torch.testing.assert_close(o.float(), ro, rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)


def test_sketch_estimator_and_criticality_go_together():
    with pytest.raises(ValueError, match="estimator='sketch' with criticality='cuboid'"):
        PsaDecodeConfig(estimator="sketch")
    with pytest.raises(ValueError, match="estimator='calibrated' with criticality='sketch'"):
        PsaDecodeConfig(criticality="sketch")
    with pytest.raises(ValueError, match="head_dim=63"):
        KeySketchPool(1, 4, 1, 63, 16)


def test_reference_pipeline_with_sketch_keeps_epsilon_and_is_dense_at_one():
    """psa_decode_reference (the CPU server's sparse path) with criticality 'sketch': the true kept mass of every query
    head reaches epsilon with fewer blocks than the context; at epsilon 1.0 it is dense attention."""
    from flashinfer_ext.common.reference import psa_decode_reference

    pool = make_pool([40 * 16 + 3, 25 * 16], 8, 2, 64, torch.bfloat16, 1, seed=21, planted=True)
    args = (pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens)
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, chunk_growth=0, **SKETCH)
    o, lse, nread, order = psa_decode_reference(*args, cfg, block_size=16, sm_scale=pool.sm_scale)
    kept = kept_mass_reference(pool.q, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, order,
                               nread, block_size=16, sm_scale=pool.sm_scale)
    assert float(kept.min()) >= 0.9 and int(nread.sum()) < (41 + 25) * 2
    o1, lse1, _, _ = psa_decode_reference(*args, cfg, block_size=16, sm_scale=pool.sm_scale, epsilon=[1.0, 1.0])
    ro, rlse = dense_decode_reference(*args, pool.sm_scale)
    torch.testing.assert_close(o1, ro, rtol=1e-4, atol=1e-4)
