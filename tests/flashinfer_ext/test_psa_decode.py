"""Contract: PsaDecodeWrapper (plan/run) = the fp32 PSA reference; epsilon = 1 is dense; kept mass >= epsilon."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.block_meta import BlockMetaPool, identity_block_table, paged_block_table
from flashinfer_ext.config import PsaDecodeConfig
from flashinfer_ext.psa_decode import PsaDecodeWrapper
from flashinfer_ext.reference import (criticality_reference, dense_decode_reference, kept_mass_reference,
                                      progressive_decode_reference)

from .kv_pool import make_pool


def build(pool, cfg, block_size, *, max_batch_size=None, meta_dtype=torch.float32):
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
                         out_dtype=pool.q.dtype)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    w.update_meta_decode(pool.k_buffer, *mp.layer(0))
    return w, mp, table


def _lists_from_wrapper(w, pool, cfg, block_size):
    n_blocks = (pool.seq_lens + block_size - 1) // block_size
    nf = torch.clamp(n_blocks, max=cfg.sink_blocks + cfg.local_blocks).to(torch.int32)
    lens = torch.minimum(n_blocks, nf + cfg.max_blocks).to(torch.int32)[:, None].expand(-1, w.num_kv_heads)
    return w.order.clone(), lens.contiguous(), nf


@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (32, 8, 128, torch.bfloat16, 16, 16),
    (9, 3, 64, torch.float16, 1, 16),
    (9, 3, 64, torch.bfloat16, 32, 32),
])
def test_wrapper_matches_reference_pipeline(hq, hk, d, dtype, page_size, block_size):
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=64)
    seq_lens = [9 * block_size + 7, 2 * block_size, 5 * block_size + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=11, planted=True)
    w, mp, table = build(pool, cfg, block_size, max_batch_size=4)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    # ranking: descending in the reference scores, sink/local first
    ref_scores = criticality_reference(pool.q, *mp.layer(0), table, pool.seq_lens, block_size=block_size,
                                       num_blocks=w.max_blocks_per_req, sink_blocks=1, local_blocks=1)
    ranked = torch.gather(ref_scores, 2, w.order)
    assert bool((ranked[..., :-1] >= ranked[..., 1:] - 1e-3).all())
    lists, lens, nf = _lists_from_wrapper(w, pool, cfg, block_size)
    ro, rlse, rnread = progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
        lists, lens, nf, block_size=block_size, sm_scale=pool.sm_scale, epsilon=cfg.epsilon,
        micro_batch_blocks=cfg.micro_batch_blocks)
    assert torch.equal(nread, rnread)
    assert bool((nread < lens).any())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)


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


@pytest.mark.parametrize("epsilon", [0.9, 0.95])
def test_true_kept_mass_reaches_epsilon_on_planted_structure(epsilon):
    """For >= 99 % of (request, query head) pairs the mass of the blocks read is >= epsilon, and
    the stop test saves reads (mean blocks read < 60 % of all blocks)."""
    cfg = PsaDecodeConfig(epsilon=epsilon, micro_batch_blocks=2, sink_blocks=1, local_blocks=1)
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
    assert read_frac < 0.6, f"read {read_frac:.2f} of all blocks: no sparsity"


def test_config_rejects_bad_values_naming_the_field():
    for kw, field in ((dict(epsilon=0.0), "epsilon"), (dict(epsilon=1.5), "epsilon"),
                      (dict(micro_batch_blocks=3), "micro_batch_blocks"), (dict(sink_blocks=-1), "sink_blocks"),
                      (dict(max_blocks=0), "max_blocks"), (dict(criticality="quest"), "criticality"),
                      (dict(group_reduce="mean"), "group_reduce"), (dict(local_blocks=True), "local_blocks")):
        with pytest.raises(ValueError, match=field):
            PsaDecodeConfig(**kw)
    assert PsaDecodeConfig(epsilon=1).epsilon == 1.0


def test_plan_rejects_batch_above_capacity():
    pool = make_pool([40, 40], 9, 3, 64, torch.bfloat16, 16, seed=14)
    w = PsaDecodeWrapper(PsaDecodeConfig(), num_qo_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                         max_batch_size=1, max_blocks_per_req=4, device="cpu")
    with pytest.raises(ValueError, match="max_batch_size"):
        w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, torch.zeros(2, 4, dtype=torch.int32))
