"""Contract: Triton block scores equal the fp32 reference; the cuboid score bounds every key of its block."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.psa.block_meta import BlockMetaPool, identity_block_table, paged_block_table
from flashinfer_ext.psa.criticality import CritTile, block_criticality, rank_blocks
from flashinfer_ext.common.reference import criticality_reference, gather_kv

from .kv_pool import make_pool


def _pool_and_meta(seq_lens, hq, hk, d, dtype, page_size, block_size, seed=3, layout="planar"):
    pool = make_pool(seq_lens, hq, hk, d, dtype, page_size, seed=seed)
    nb = -(-max(seq_lens) // block_size)
    if page_size > 1:
        table = paged_block_table(pool.req_to_token, pool.req_pool_indices, page_size, nb)
    else:
        table = identity_block_table(pool.req_pool_indices, nb)
    mp = BlockMetaPool(1, int(table.max()) + 1, hk, d, block_size, dtype=dtype, layout=layout)
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


def test_int16_sort_keys_preserve_score_order():
    """keys_out: the top 16 bits of the fp32 score, order-preserving (+inf > finite > -inf, signs handled)."""
    pool, table, (kmin, kmax, kmean), nb = _pool_and_meta([200, 77], 9, 3, 64, torch.bfloat16, 16, 16, seed=5)
    scores = torch.empty(2, 3, nb + 3)
    keys = torch.empty(2, 3, nb + 3, dtype=torch.int16)
    block_criticality(pool.q, kmin, kmax, kmean, table, pool.seq_lens, scores, block_size=16, sink_blocks=1,
                      local_blocks=2, keys_out=keys)
    trunc = (scores.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16 truncation of the scores
    a, b = trunc.flatten()[:, None], trunc.flatten()[None, :]
    ka, kb = keys.flatten()[:, None].int(), keys.flatten()[None, :].int()
    assert bool(((a < b) == (ka < kb)).all()) and bool(((a == b) == (ka == kb)).all())
    assert bool((scores < 0).any() & (scores > 0).any() & torch.isinf(scores).any())
    order = torch.empty(2, 3, nb + 3, dtype=torch.int64)
    rank_blocks(keys, torch.empty_like(keys), order)
    ranked = torch.gather(trunc, 2, order)
    assert bool((ranked[..., :-1] >= ranked[..., 1:]).all())


@pytest.mark.parametrize("cols,prefix", [(100, 16), (3000, 256), (40, 64), (700, 64)])
def test_rank_select_sorted_prefix_then_block_order(cols, prefix):
    """Exact top-prefix by key (ties at the threshold in block order), the rest in block order: a permutation."""
    from flashinfer_ext.psa.rank_select import rank_select

    g = torch.Generator().manual_seed(cols)
    keys = torch.randint(-300, 300, (2, 3, cols), generator=g, dtype=torch.int16)  # many ties
    keys[..., :2] = 32640  # +inf (forced) keys
    keys[0, :, cols - 5:] = -32641  # -inf (past the end) keys
    order = torch.empty(2, 3, cols, dtype=torch.int64)
    rank_select(keys, order, torch.empty(6 * prefix, dtype=torch.int32), prefix=prefix, tile=256)
    check_rank_order(order, keys, prefix)
    assert all(set(order[r, h, :2].tolist()) == {0, 1} for r in range(2) for h in range(3))


def check_rank_order(order: torch.Tensor, keys: torch.Tensor, prefix: int) -> None:
    """rank_select's contract on every (request, KV head) row of ``order`` ``[B, H, cols]`` for int16 ``keys``: a
    permutation whose first ``min(prefix, cols)`` blocks hold the top keys in descending order, ties by the higher
    block id first, and whose remaining blocks are in block order."""
    order, keys = order.cpu(), keys.cpu()
    cols = keys.shape[-1]
    n = min(prefix, cols)
    for r in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            o, kk = order[r, h], keys[r, h].int()
            assert sorted(o.tolist()) == list(range(cols))
            assert torch.equal(kk[o[:n]], kk.sort(descending=True).values[:n])
            top = [(int(kk[i]), int(i)) for i in o[:n]]
            assert top == sorted(top, reverse=True)
            assert o[n:].tolist() == sorted(o[n:].tolist())


def test_rank_select_extreme_keys_and_padding_sort_exactly():
    """Keys at both ends of int16 (the packed int32 sort's extremes) and fewer blocks than the prefix (padding in the
    sort, equal to the packed (lowest key, block 0)): a full descending sort, ties by the higher block id first."""
    from flashinfer_ext.psa.rank_select import rank_select

    cols, prefix = 100, 128
    g = torch.Generator().manual_seed(5)
    keys = torch.randint(-5, 5, (1, 2, cols), generator=g, dtype=torch.int16)
    keys[:, :, 0] = -32768
    keys[:, :, 7] = -32768
    keys[:, :, 3] = 32767
    keys[:, :, 50] = 32767
    order = torch.empty(1, 2, cols, dtype=torch.int64)
    rank_select(keys, order, torch.empty(2 * prefix, dtype=torch.int32), prefix=prefix, tile=64)
    for h in range(2):
        kk = keys[0, h].int()
        want = sorted(range(cols), key=lambda i: (int(kk[i]), i), reverse=True)
        assert order[0, h].tolist() == want
        assert want[:2] == [50, 3] and want[-2:] == [7, 0]


def test_rank_reference_prefix_semantics():
    from flashinfer_ext.common.reference import rank_reference

    s = torch.tensor([[[1.0, 5.0, 3.0, float("inf"), 2.0, 4.0, float("-inf")]]])
    assert rank_reference(s, 0)[0, 0].tolist() == [3, 1, 5, 2, 4, 0, 6]
    assert rank_reference(s, 3)[0, 0].tolist() == [3, 1, 5, 0, 2, 4, 6]


@pytest.mark.parametrize("layout", BlockMetaPool.LAYOUTS)
@pytest.mark.parametrize("tile", [CritTile(), CritTile(tile_b=16, num_warps=4), CritTile(heads=0),
                                  CritTile(heads=0, tile_b=2)], ids=["default", "tile16", "all-heads", "all-heads-2"])
@pytest.mark.parametrize("hq,hk,d,dtype", [(32, 8, 128, torch.bfloat16), (9, 3, 64, torch.float16)])
def test_launch_shape_and_meta_layout_leave_scores_and_keys_unchanged(layout, tile, hq, hk, d, dtype):
    """Every CritTile (KV heads per program, blocks per program) over either metadata layout writes the reference's
    scores and the int16 rank keys (within one bf16 step) as the default launch on planar metadata (partial blocks, padded heads)."""
    seq_lens = [3 * 16 + 5, 16, 7 * 16 - 1]
    pool, table, meta, nb = _pool_and_meta(seq_lens, hq, hk, d, dtype, 16, 16, layout=layout)
    _, _, planar, _ = _pool_and_meta(seq_lens, hq, hk, d, dtype, 16, 16)
    cols = nb + 2
    kw = dict(block_size=16, sink_blocks=1, local_blocks=2, rank_by="mean")
    scores, keys = torch.empty(len(seq_lens), hk, cols), torch.empty(len(seq_lens), hk, cols, dtype=torch.int16)
    block_criticality(pool.q, *meta, table, pool.seq_lens, scores, keys_out=keys, tile=tile, **kw)
    want, want_keys = torch.empty_like(scores), torch.empty_like(keys)
    block_criticality(pool.q, *planar, table, pool.seq_lens, want, keys_out=want_keys, **kw)
    ref = criticality_reference(pool.q, *planar, table, pool.seq_lens, block_size=16, num_blocks=cols,
                                sink_blocks=1, local_blocks=2, criticality="cuboid", group_reduce="max")
    torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-4)  # the reduction order over dims may differ
    assert int((keys.int() - want_keys.int()).abs().max()) <= 1  # int16 keys: at most one bf16 step apart


def test_crit_tile_rejects_bad_fields():
    for kw in (dict(heads=2), dict(tile_b=3), dict(num_warps=6), dict(elements=-1)):
        with pytest.raises(ValueError, match="CritTile"):
            CritTile(**kw)
