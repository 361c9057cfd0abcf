"""Contract: Triton block scores equal the fp32 reference; the cuboid score bounds every key of its block."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.block_meta import BlockMetaPool, identity_block_table, paged_block_table
from flashinfer_ext.criticality import block_criticality, rank_blocks
from flashinfer_ext.reference import criticality_reference, gather_kv

from .kv_pool import make_pool


def _pool_and_meta(seq_lens, hq, hk, d, dtype, page_size, block_size, seed=3):
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=seed)
    nb = -(-max(seq_lens) // block_size)
    if page_size > 1:
        table = paged_block_table(pool.req_to_token, pool.req_pool_indices, page_size, nb)
    else:
        table = identity_block_table(pool.req_pool_indices, nb)
    mp = BlockMetaPool(1, int(table.max()) + 1, hk, d, block_size, dtype=dtype)
    zero = torch.zeros(len(seq_lens), dtype=torch.int32)
    mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, nb)
    return pool, table, mp.layer(0), nb


@pytest.mark.parametrize("hq,hk,d,dtype,page_size,block_size", [
    (32, 8, 128, torch.bfloat16, 16, 16),
    (9, 3, 64, torch.float16, 1, 16),
    (9, 3, 128, torch.bfloat16, 32, 32),
    (32, 8, 64, torch.float16, 64, 64),
])
@pytest.mark.parametrize("criticality,group_reduce", [("cuboid", "max"), ("cuboid", "sum"), ("mean", "max")])
def test_scores_match_reference_over_gqa_and_partial_blocks(hq, hk, d, dtype, page_size, block_size,
                                                            criticality, group_reduce):
    seq_lens = [3 * block_size + 5, block_size, 7 * block_size - 1]
    pool, table, (kmin, kmax, kmean), nb = _pool_and_meta(seq_lens, hq, hk, d, dtype, page_size, block_size)
    cols = nb + 2  # extra columns past every request's end must read -inf
    scores = torch.empty(len(seq_lens), hk, cols)
    block_criticality(pool.q, kmin, kmax, kmean, table, pool.seq_lens, scores, block_size=block_size,
                      sink_blocks=1, local_blocks=2, criticality=criticality, group_reduce=group_reduce)
    ref = criticality_reference(pool.q, kmin, kmax, kmean, table, pool.seq_lens, block_size=block_size,
                                num_blocks=cols, sink_blocks=1, local_blocks=2, criticality=criticality,
                                group_reduce=group_reduce)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-3)
    order = torch.empty(len(seq_lens), hk, cols, dtype=torch.int64)
    rank_blocks(scores, torch.empty_like(scores), order)
    ranked = torch.gather(ref, 2, order)
    assert bool((ranked[..., :-1] >= ranked[..., 1:] - 1e-3).all()), "order is not descending in score"


def test_cuboid_score_bounds_every_query_head_key_product():
    """Per query head, the cuboid bound is >= q.k of every key in the block (group max >= each head)."""
    hq, hk, d, B = 9, 3, 64, 16
    pool, table, (kmin, kmax, kmean), nb = _pool_and_meta([150], hq, hk, d, torch.bfloat16, 16, B, seed=4)
    scores = torch.empty(1, hk, nb)
    block_criticality(pool.q, kmin, kmax, kmean, table, pool.seq_lens, scores, block_size=B,
                      sink_blocks=0, local_blocks=0)
    k = gather_kv(pool.k_buffer, pool.req_to_token, int(pool.req_pool_indices[0]), 150)
    qk = torch.einsum("hgd,lhd->hgl", pool.q[0].float().view(hk, hq // hk, d), k)  # [hk, G, L]
    for b in range(nb):
        blk_max = qk[:, :, b * B:(b + 1) * B].amax(-1).amax(-1)  # [hk]
        assert bool((scores[0, :, b] >= blk_max - 1e-3).all())
