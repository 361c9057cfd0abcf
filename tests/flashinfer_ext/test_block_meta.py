"""Contract: block metadata kept by incremental updates equals the fp32 from-scratch reference."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.psa.block_meta import (BlockMetaPool, blocks_touched, identity_block_table,
                                       paged_block_table)
from flashinfer_ext.common.reference import block_meta_reference

from .kv_pool import make_pool

CASES = [
    # seq_lens, num_kv_heads, head_dim, dtype, page_size, block_size
    ([37, 16, 70], 8, 128, torch.bfloat16, 16, 16),
    ([45, 3], 3, 64, torch.float16, 1, 16),
    ([100, 64], 2, 64, torch.bfloat16, 32, 32),
    ([65, 1], 2, 64, torch.float16, 64, 64),
    ([29, 50], 3, 64, torch.bfloat16, 1, 8),
]


def _table(pool, block_size, num_blocks):
    if pool.page_size > 1:
        return paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, num_blocks)
    return identity_block_table(pool.req_pool_indices, num_blocks)


def _meta_rows(meta, table, r, n):
    return tuple(x[table[r, :n].long()].float() for x in meta)


@pytest.mark.parametrize("layout", BlockMetaPool.LAYOUTS)
@pytest.mark.parametrize("seq_lens,num_kv_heads,head_dim,dtype,page_size,block_size", CASES)
def test_incremental_updates_match_from_scratch_reference(seq_lens, num_kv_heads, head_dim, dtype,
                                                          page_size, block_size, layout):
    """Prefill in uneven chunks (starting mid-block), then decode token by token: rows equal the reference, in
    either metadata layout."""
    pool = make_pool(seq_lens, num_kv_heads, num_kv_heads, head_dim, dtype, page_size, seed=1)
    batch = len(seq_lens)
    num_blocks = -(-max(seq_lens) // block_size)
    table = _table(pool, block_size, num_blocks)
    rows = int(table.max()) + 1
    mp = BlockMetaPool(2, rows, num_kv_heads, head_dim, block_size, dtype=torch.float32, layout=layout)
    # poison the pool: a correct update never reads a row it has not written
    for x in (mp.kmin, mp.kmax, mp.kmean):
        x.fill_(12345.0)
    final = torch.tensor(seq_lens, dtype=torch.int32)
    prefill = torch.clamp(final - 5, min=0)
    cut = torch.clamp(prefill * 3 // 5 + 1, max=prefill)  # chunk boundary inside a block
    for start, end in ((torch.zeros_like(prefill), cut), (cut, prefill)):
        mp.update(1, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, start, end,
                  blocks_touched(start.tolist(), end.tolist(), block_size))
    cur = prefill.clone()
    while bool((cur < final).any()):
        nxt = torch.minimum(cur + 1, final)
        mp.update(1, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, cur, nxt, 1)
        cur = nxt
    ref = block_meta_reference(pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, block_size)
    for r in range(batch):
        n = ref[r][0].shape[0]
        got = _meta_rows(mp.layer(1), table, r, n)
        torch.testing.assert_close(got[0], ref[r][0], rtol=0, atol=0)   # min/max are exact
        torch.testing.assert_close(got[1], ref[r][1], rtol=0, atol=0)
        torch.testing.assert_close(got[2], ref[r][2], rtol=1e-5, atol=1e-5)
    # layer 0 untouched
    assert bool((mp.kmin[0] == 12345.0).all())


def test_bf16_pool_stores_rounded_reference_values():
    """A bf16 metadata pool holds the fp32 reference rounded to bf16 (mean within bf16 precision)."""
    pool = make_pool([40, 23], 2, 2, 64, torch.bfloat16, 16, seed=2)
    table = _table(pool, 16, 3)
    mp = BlockMetaPool(1, int(table.max()) + 1, 2, 64, 16, dtype=torch.bfloat16)
    zero = torch.zeros(2, dtype=torch.int32)
    mp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, 3)
    ref = block_meta_reference(pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, 16)
    for r in range(2):
        got = _meta_rows(mp.layer(0), table, r, ref[r][0].shape[0])
        torch.testing.assert_close(got[0], ref[r][0], rtol=0, atol=0)
        torch.testing.assert_close(got[2], ref[r][2].bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_blocks_touched_counts_block_span_of_each_range():
    assert blocks_touched([0, 15, 16], [16, 17, 16], 16) == 2
    assert blocks_touched([5], [6], 16) == 1
    assert blocks_touched([3], [3], 16) == 0


def test_pool_rejects_unknown_layout():
    with pytest.raises(ValueError, match="layout='rows'"):
        BlockMetaPool(1, 4, 2, 64, 16, layout="rows")
