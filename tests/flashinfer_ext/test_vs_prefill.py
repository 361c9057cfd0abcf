"""Contract: Triton vertical/slash sparse prefill equals fp32 masked attention with the same mask;
alpha = 1 (all lines) equals dense causal attention; two chunks equal one chunk."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.reference import vs_prefill_reference
from flashinfer_ext.loopserve.vs_prefill import vs_prefill

from .kv_pool import make_pool

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _random_lines(hk, seq_len, n_v, n_s, seed, sink=2, local=4):
    """Per KV head random vertical positions / slash offsets (+ sink, local), padded with -1."""
    g = torch.Generator().manual_seed(seed)
    v_idx = torch.full((hk, seq_len), -1, dtype=torch.int32)
    s_idx = torch.full((hk, seq_len), -1, dtype=torch.int32)
    v_cnt = torch.zeros(hk, dtype=torch.int32)
    s_cnt = torch.zeros(hk, dtype=torch.int32)
    for h in range(hk):
        v = sorted(set(range(min(sink, seq_len))) | set(torch.randperm(seq_len, generator=g)[:n_v].tolist()))
        s = set(range(min(local, seq_len))) | set(torch.randperm(seq_len, generator=g)[:n_s].tolist())
        s = list(s)  # slash offsets in any order
        v_idx[h, :len(v)] = torch.tensor(v, dtype=torch.int32)
        s_idx[h, :len(s)] = torch.tensor(s, dtype=torch.int32)
        v_cnt[h], s_cnt[h] = len(v), len(s)
    return v_idx, v_cnt, s_idx, s_cnt


def _setup(seq_len, hq, hk, d, dtype, page, seed):
    pool = make_pool([seq_len], hq, hk, d, dtype, page, seed=seed)
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    q_all = torch.randn(seq_len, hq, d, generator=torch.Generator().manual_seed(seed + 7)).to(dtype)
    return pool, slots, q_all


@pytest.mark.parametrize("hq,hk,d,dtype,page,seq_len,prefix_len", [
    (4, 1, 64, torch.bfloat16, 16, 133, 0),     # whole prompt, partial last page
    (9, 3, 64, torch.float16, 1, 150, 37),      # prefix hit, odd lengths, page size 1
    (9, 3, 128, torch.bfloat16, 16, 97, 80),    # short segment after a long prefix
    (8, 2, 128, torch.float16, 32, 70, 69),     # one token
])
def test_vs_prefill_matches_masked_reference(hq, hk, d, dtype, page, seq_len, prefix_len):
    pool, slots, q_all = _setup(seq_len, hq, hk, d, dtype, page, seed=1)
    q = q_all[prefix_len:]
    lines = _random_lines(hk, seq_len, n_v=seq_len // 6, n_s=seq_len // 8, seed=2)
    kw = dict(prefix_len=prefix_len, seq_len=seq_len, v_idx=lines[0], v_cnt=lines[1], s_idx=lines[2],
              s_cnt=lines[3], sm_scale=d ** -0.5)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, block_n=32, **kw)
    ro, rlse = vs_prefill_reference(q, pool.k_buffer, pool.v_buffer, slots, **kw)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (seq_len - prefix_len, hq)
    torch.testing.assert_close(o.float(), ro, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("block_m,block_n", [(128, 32), (128, 128), (64, 128), (16, 16)])
def test_vs_prefill_tile_shape_changes_nothing_but_summation_order(block_m, block_n):
    """Every launch shape the sweep (bench/vs_prefill_sweep.py) may pick gives the reference's result."""
    hq, hk, d, dtype, seq_len, prefix_len = 9, 3, 64, torch.bfloat16, 203, 40
    pool, slots, q_all = _setup(seq_len, hq, hk, d, dtype, 16, seed=5)
    q = q_all[prefix_len:]
    lines = _random_lines(hk, seq_len, n_v=seq_len // 5, n_s=seq_len // 7, seed=6)
    kw = dict(prefix_len=prefix_len, seq_len=seq_len, v_idx=lines[0], v_cnt=lines[1], s_idx=lines[2],
              s_cnt=lines[3], sm_scale=d ** -0.5)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, block_m=block_m, block_n=block_n, num_warps=8,
                        num_stages=2, **kw)
    ro, rlse = vs_prefill_reference(q, pool.k_buffer, pool.v_buffer, slots, **kw)
    torch.testing.assert_close(o.float(), ro, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("hq,hk,d,dtype", [(4, 1, 128, torch.float16), (9, 3, 64, torch.bfloat16)])
def test_all_lines_equal_dense_causal_attention(hq, hk, d, dtype):
    seq_len, prefix_len = 111, 29
    pool, slots, q_all = _setup(seq_len, hq, hk, d, dtype, 16, seed=3)
    q = q_all[prefix_len:]
    full = torch.arange(seq_len, dtype=torch.int32).expand(hk, seq_len).contiguous()
    cnt = torch.full((hk,), seq_len, dtype=torch.int32)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, prefix_len=prefix_len, seq_len=seq_len,
                        v_idx=full, v_cnt=cnt, s_idx=full, s_cnt=cnt, sm_scale=d ** -0.5)
    causal = (torch.arange(prefix_len, seq_len)[:, None] >= torch.arange(seq_len)[None, :]).expand(hk, -1, -1)
    do, dlse = vs_prefill_reference(q, pool.k_buffer, pool.v_buffer, slots, prefix_len=prefix_len, seq_len=seq_len,
                                    v_idx=None, v_cnt=None, s_idx=None, s_cnt=None, sm_scale=d ** -0.5, mask=causal)
    torch.testing.assert_close(o.float(), do, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse, dlse, rtol=1e-4, atol=1e-3)


def test_two_chunks_equal_one_chunk():
    """Chunked prefill: chunk 2 attends over every earlier key in the pool; same lines, same result."""
    seq_len, prefix_len, cut = 140, 20, 83
    hq, hk, d, dtype = 9, 3, 64, torch.bfloat16
    pool, slots, q_all = _setup(seq_len, hq, hk, d, dtype, 16, seed=4)
    v_idx, v_cnt, s_idx, s_cnt = _random_lines(hk, seq_len, n_v=15, n_s=12, seed=5)
    kw = dict(v_idx=v_idx, v_cnt=v_cnt, s_idx=s_idx, s_cnt=s_cnt, sm_scale=d ** -0.5)
    o1, l1 = vs_prefill(q_all[prefix_len:], pool.k_buffer, pool.v_buffer, slots, prefix_len=prefix_len,
                        seq_len=seq_len, **kw)
    # chunk 1 sees keys < cut only: its lines are the same sets restricted to < cut
    va, vc, sa, sc = (x.clone() for x in (v_idx, v_cnt, s_idx, s_cnt))
    for h in range(hk):
        keep_v = [x for x in v_idx[h, : int(v_cnt[h])].tolist() if x < cut]
        keep_s = [x for x in s_idx[h, : int(s_cnt[h])].tolist() if x < cut]
        va[h].fill_(-1), sa[h].fill_(-1)
        va[h, :len(keep_v)], sa[h, :len(keep_s)] = torch.tensor(keep_v), torch.tensor(keep_s)
        vc[h], sc[h] = len(keep_v), len(keep_s)
    oa, la = vs_prefill(q_all[prefix_len:cut], pool.k_buffer, pool.v_buffer, slots, prefix_len=prefix_len,
                        seq_len=cut, v_idx=va, v_cnt=vc, s_idx=sa, s_cnt=sc, sm_scale=d ** -0.5)
    ob, lb = vs_prefill(q_all[cut:], pool.k_buffer, pool.v_buffer, slots, prefix_len=cut, seq_len=seq_len, **kw)
    torch.testing.assert_close(torch.cat([oa, ob]).float(), o1.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(torch.cat([la, lb]), l1, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seq_len,prefix_len", [(4096, 0), (8192, 6144)])
def test_gpu_vs_prefill_llama_shapes(seq_len, prefix_len):
    """Llama-3.1-8B shapes (32/8 heads, d=128, bf16), page size 1, ~5 % lines per head."""
    pool = make_pool([seq_len], 32, 8, 128, torch.bfloat16, 1, seed=21, device="cuda")
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    q = torch.randn(seq_len - prefix_len, 32, 128, device="cuda").to(torch.bfloat16)
    lines = [x.cuda() for x in _random_lines(8, seq_len, n_v=seq_len // 20, n_s=seq_len // 40, seed=22, local=64)]
    kw = dict(prefix_len=prefix_len, seq_len=seq_len, v_idx=lines[0], v_cnt=lines[1], s_idx=lines[2],
              s_cnt=lines[3], sm_scale=128 ** -0.5)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, **kw)
    rows = torch.arange(0, seq_len - prefix_len, 97)  # reference on a subset of query rows (CPU memory)
    ro, rlse = vs_prefill_reference(q.cpu(), pool.k_buffer.cpu(), pool.v_buffer.cpu(), slots.cpu(),
                                    **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
    torch.testing.assert_close(o.float().cpu()[rows], ro[rows], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.cpu()[rows], rlse[rows], rtol=1e-3, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_vs_prefill_testbed_shape_default_launch():
    """The testbed model's shape (9/3 heads, d=64, bf16) at the kernel's default launch for d 64 (launch_shape:
    32-key tiles, 4 warps, 1 stage), ~15 % lines per head, against the reference on a subset of rows."""
    seq_len, prefix_len = 6144, 0
    pool = make_pool([seq_len], 9, 3, 64, torch.bfloat16, 1, seed=31, device="cuda")
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    q = torch.randn(seq_len, 9, 64, device="cuda").to(torch.bfloat16)
    lines = [x.cuda() for x in _random_lines(3, seq_len, n_v=seq_len // 8, n_s=seq_len // 12, seed=32, local=64)]
    kw = dict(prefix_len=prefix_len, seq_len=seq_len, v_idx=lines[0], v_cnt=lines[1], s_idx=lines[2],
              s_cnt=lines[3], sm_scale=64 ** -0.5)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, **kw)
    rows = torch.arange(0, seq_len, 89)
    ro, rlse = vs_prefill_reference(q.cpu(), pool.k_buffer.cpu(), pool.v_buffer.cpu(), slots.cpu(),
                                    **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
    torch.testing.assert_close(o.float().cpu()[rows], ro[rows], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.cpu()[rows], rlse[rows], rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("prefix_len", [0, 450])
def test_vs_prefill_with_a_few_far_slashes_visits_only_crossed_blocks_and_matches_reference(prefix_len):
    """The local window plus two far offsets (bands crossing block edges) and no vertical past the sink over
    600 keys in 32-key blocks: phase B jumps over the blocks no band crosses; the result is the masked
    reference's."""
    hq, hk, d, dtype, seq_len = 4, 2, 64, torch.bfloat16, 600
    pool, slots, q_all = _setup(seq_len, hq, hk, d, dtype, 16, seed=5)
    q = q_all[prefix_len:]
    v_idx = torch.tensor([[0, 1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    v_cnt = torch.tensor([2, 4], dtype=torch.int32)
    s_idx = torch.tensor([[0, 1, 2, 3, 77, 301], [0, 1, 2, 40, 513, -1]], dtype=torch.int32)
    s_cnt = torch.tensor([6, 5], dtype=torch.int32)
    kw = dict(prefix_len=prefix_len, seq_len=seq_len, v_idx=v_idx, v_cnt=v_cnt, s_idx=s_idx, s_cnt=s_cnt,
              sm_scale=d ** -0.5)
    o, lse = vs_prefill(q, pool.k_buffer, pool.v_buffer, slots, block_n=32, **kw)
    ro, rlse = vs_prefill_reference(q, pool.k_buffer, pool.v_buffer, slots, **kw)
    torch.testing.assert_close(o.float(), ro, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse, rlse, rtol=1e-4, atol=1e-3)
