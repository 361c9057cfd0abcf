"""Contract: the Triton sparse/progressive decode equals its fp32 reference (same lists, same stops)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.reference import dense_decode_reference, progressive_decode_reference
from flashinfer_ext.common.sparse_decode import sparse_decode

from .kv_pool import make_pool

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _random_lists(seq_lens, hk, block_size, n_forced, seed):
    """Per (request, KV head) a random permutation of its blocks, sink + local blocks first."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-s // block_size) for s in seq_lens]
    lists = torch.zeros(len(seq_lens), hk, max(nbs), dtype=torch.int64)
    lens = torch.zeros(len(seq_lens), hk, dtype=torch.int32)
    for r, nb in enumerate(nbs):
        forced = sorted(set(range(min(1, nb))) | set(range(max(0, nb - (n_forced - 1)), nb)))
        rest = [b for b in range(nb) if b not in forced]
        for h in range(hk):
            perm = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
            lists[r, h, :nb] = torch.tensor(forced + perm)
            lens[r, h] = nb
    nf = torch.tensor([min(nb, n_forced) for nb in nbs], dtype=torch.int32)
    return lists, lens, nf


@pytest.mark.parametrize("hq,hk,d,dtype,block_size", [
    (32, 8, 128, torch.bfloat16, 16),
    (9, 3, 64, torch.float16, 16),
    (9, 3, 128, torch.bfloat16, 32),
    (32, 8, 64, torch.float16, 64),
])
@pytest.mark.parametrize("epsilon", [1.0, 0.8])
def test_progressive_decode_matches_reference(hq, hk, d, dtype, block_size, epsilon):
    seq_lens = [4 * block_size + 3, block_size - 5, 6 * block_size]
    pool = make_pool(seq_lens, hq, hk, d, dtype, block_size, seed=5)
    lists, lens, nf = _random_lists(seq_lens, hk, block_size, 3, seed=6)
    o, lse, nread = sparse_decode(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                  pool.seq_lens, lists, lens, nf, block_size=block_size, sm_scale=pool.sm_scale,
                                  epsilon=epsilon, micro_batch_blocks=2)
    ro, rlse, rnread = progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, lists, lens,
        nf, block_size=block_size, sm_scale=pool.sm_scale, epsilon=epsilon, micro_batch_blocks=2)
    assert torch.equal(nread, rnread)
    if epsilon < 1.0:
        assert bool((nread < lens).any()), "the stop test never fired: the case does not exercise it"
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), ro, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)


def test_full_lists_equal_dense_attention_with_base2_lse():
    """epsilon = 1 over all blocks is dense decode; lse is log2(sum exp(q.k * sm_scale))."""
    seq_lens = [77, 16, 130]
    pool = make_pool(seq_lens, 9, 3, 64, torch.float16, 1, seed=7)
    lists, lens, nf = _random_lists(seq_lens, 3, 8, 3, seed=8)
    o, lse, nread = sparse_decode(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                  pool.seq_lens, lists, lens, nf, block_size=8, sm_scale=pool.sm_scale)
    do, dlse = dense_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, pool.sm_scale)
    assert torch.equal(nread, lens)
    torch.testing.assert_close(o.float(), do, rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(lse, dlse, rtol=1e-4, atol=1e-3)


def test_token_lists_block_size_one_attend_exactly_the_listed_tokens():
    """LoopServe use: block size 1, a different token subset and length per KV head."""
    seq_lens = [90, 41]
    hq, hk, d = 9, 3, 64
    pool = make_pool(seq_lens, hq, hk, d, torch.bfloat16, 1, seed=9)
    g = torch.Generator().manual_seed(10)
    lists = torch.zeros(2, hk, 60, dtype=torch.int64)
    lens = torch.zeros(2, hk, dtype=torch.int32)
    for r, L in enumerate(seq_lens):
        for h in range(hk):
            n = int(torch.randint(5, min(L, 60), (1,), generator=g))
            lists[r, h, :n] = torch.randperm(L, generator=g)[:n]
            lens[r, h] = n
    nf = torch.zeros(2, dtype=torch.int32)
    o, lse, nread = sparse_decode(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                  pool.seq_lens, lists, lens, nf, block_size=1, sm_scale=pool.sm_scale)
    ro, rlse, _ = progressive_decode_reference(
        pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, lists, lens,
        nf, block_size=1, sm_scale=pool.sm_scale, epsilon=1.0, micro_batch_blocks=8)
    assert torch.equal(nread, lens)
    torch.testing.assert_close(o.float(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
