"""Contract: the split-list sparse decode equals the fp32 reference and the one-program sparse decode on the same
lists, for any split count (empty spans included), and its plan covers every list entry. (Both kernels run the
shared tile helpers of ``flashinfer_ext.common.tile_attention``.)"""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.reference import progressive_decode_reference
from flashinfer_ext.common.sparse_decode import sparse_decode
from flashinfer_ext.common.split_decode import SplitPlan, alloc_split_buffers, plan_splits, sparse_decode_split

from .kv_pool import make_pool

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _lists(seq_lens, hk, block_size, width, seed, device="cpu"):
    """Per (request, KV head) a random subset of its blocks in random order, of random length <= width
    (some pairs empty, one pair full when its context allows)."""
    g = torch.Generator().manual_seed(seed)
    lists = torch.zeros(len(seq_lens), hk, width, dtype=torch.int32)
    lens = torch.zeros(len(seq_lens), hk, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        nb = -(-s // block_size)
        for h in range(hk):
            n = min(nb, width) if (r, h) == (0, 0) else int(torch.randint(0, min(nb, width) + 1, (1,), generator=g))
            lists[r, h, :n] = torch.randperm(nb, generator=g)[:n].to(torch.int32)
            lens[r, h] = n
    return lists.to(device), lens.to(device)


def _reference(pool, lists, lens, block_size):
    """fp32 reference; an empty pair is given one entry (the reference needs one; callers ignore those rows)."""
    nf = torch.zeros(lists.shape[0], dtype=torch.int32)
    return progressive_decode_reference(
        pool.q.cpu(), pool.k_buffer.cpu(), pool.v_buffer.cpu(), pool.req_to_token.cpu(), pool.req_pool_indices.cpu(),
        pool.seq_lens.cpu(), lists.cpu().long(), lens.cpu().clamp(min=1), nf, block_size=block_size, sm_scale=pool.sm_scale,
        epsilon=1.0, micro_batch_blocks=8)


def _check(pool, lists, lens, block_size, num_splits, dtype):
    sub = plan_splits(1, 1, block_size=block_size, target_programs=1).sub
    width = lists.shape[2]
    chunk = max(sub, -(-(-(-width // num_splits)) // sub) * sub)
    plan = SplitPlan(num_splits=num_splits, chunk=chunk, sub=sub)
    o, lse, nread = sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                        pool.seq_lens, lists, lens, plan, block_size=block_size, sm_scale=pool.sm_scale)
    ro, rlse, _ = _reference(pool, lists, lens, block_size)
    assert o.dtype == dtype and torch.equal(nread.cpu(), lens.cpu())
    empty = (lens == 0).repeat_interleave(pool.q.shape[1] // pool.k_buffer.shape[1], dim=1).cpu()
    assert bool(torch.isinf(lse.cpu()[empty]).all()) and bool((o.cpu()[empty] == 0).all())
    torch.testing.assert_close(o.float().cpu()[~empty], ro[~empty], rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse.cpu()[~empty], rlse[~empty], rtol=1e-4, atol=1e-3)
    return o, lse


@pytest.mark.parametrize("hq,hk,d,dtype,block_size", [
    (9, 3, 64, torch.bfloat16, 1),     # SmolLM2 shape, LoopServe token lists
    (9, 3, 64, torch.float16, 1),
    (8, 8, 64, torch.float16, 16),     # GQA 1, pages with a partial last page
    (32, 4, 128, torch.bfloat16, 1),   # GQA 8
    (32, 8, 128, torch.bfloat16, 16),  # Llama-3.1-8B shape
])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_decode_matches_fp32_reference_for_any_split_count(hq, hk, d, dtype, block_size, num_splits):
    seq_lens = [150, 37, 96] if block_size == 1 else [5 * block_size + 3, block_size - 5, 3 * block_size]
    pool = make_pool(seq_lens, hq, hk, d, dtype, block_size, seed=21)
    width = 140 if block_size == 1 else 6
    lists, lens = _lists(seq_lens, hk, block_size, width, seed=22)
    _check(pool, lists, lens, block_size, num_splits, dtype)


def test_split_decode_cuts_each_list_by_its_own_length():
    """A plan sized for a list far wider than the real ones (a graph's ``graph_list_width``): each pair's list is
    cut into the plan's spans by its own length (here 7 spans of one 16-entry tile for a 100-entry list, where the
    plan's 512-entry chunk would leave it one span), and the result equals the fp32 reference."""
    seq_lens = [300, 120]
    pool = make_pool(seq_lens, 4, 2, 16, torch.bfloat16, 1, seed=35)
    lists, lens = _lists(seq_lens, 2, 1, 100, seed=36)
    plan = SplitPlan(num_splits=8, chunk=512, sub=16)
    po, plse = alloc_split_buffers(2, 4, 16, 8, "cpu")
    po.fill_(float("nan"))
    plse.fill_(float("nan"))
    sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                        pool.seq_lens, lists, lens, plan, block_size=1, sm_scale=pool.sm_scale, partial_o_buf=po,
                        partial_lse_buf=plse)
    n0 = int(lens[0, 0])  # the full pair: 100 entries
    spans = -(-n0 // 16)
    row = 0  # request 0, qo head 0 (KV head 0)
    assert bool(torch.isfinite(plse[row, :spans]).all()) and bool(torch.isinf(plse[row, spans:]).all())
    _check(pool, lists, lens, 1, 8, torch.bfloat16)


def test_split_decode_equals_one_program_sparse_decode():
    """Same lists, same sets: the split path and :func:`sparse_decode` (epsilon 1) agree, reads included."""
    seq_lens = [200, 64]
    pool = make_pool(seq_lens, 9, 3, 64, torch.bfloat16, 1, seed=23)
    lists, lens = _lists(seq_lens, 3, 1, 180, seed=24)
    so, slse, sn = sparse_decode(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                 pool.seq_lens, lists, lens, torch.zeros(2, dtype=torch.int32), block_size=1,
                                 sm_scale=pool.sm_scale, epsilon=1.0)
    plan = plan_splits(180, 2 * 3, block_size=1, target_programs=24, tile_tokens=64)
    assert plan.num_splits == 3  # 180 entries = 3 tiles of 64: one span each
    o, lse, n = sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                    pool.seq_lens, lists, lens, plan, block_size=1, sm_scale=pool.sm_scale)
    assert torch.equal(n, sn)
    torch.testing.assert_close(o.float(), so.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, slse, rtol=1e-4, atol=1e-3)


def test_split_decode_merges_more_spans_than_one_merge_tile():
    """A graph plans its spans for its widest list (~90 at 32k): the merge walks them in tiles of at most 64
    spans; 70 spans (two tiles, the second partly masked, many spans empty) equal the fp32 reference."""
    seq_lens = [4600, 300]
    pool = make_pool(seq_lens, 4, 2, 16, torch.bfloat16, 1, seed=31)
    lists, lens = _lists(seq_lens, 2, 1, 4480, seed=32)
    _check(pool, lists, lens, 1, 70, torch.bfloat16)


def test_split_decode_launch_parameters_do_not_change_outputs():
    """A plan's ``num_warps`` / ``num_stages`` change how the span kernel runs, never what it computes."""
    seq_lens = [300, 90]
    pool = make_pool(seq_lens, 9, 3, 64, torch.bfloat16, 1, seed=33)
    lists, lens = _lists(seq_lens, 3, 1, 260, seed=34)
    outs = []
    for num_warps, num_stages in ((2, 1), (8, 3)):
        plan = SplitPlan(num_splits=2, chunk=192, sub=64, num_warps=num_warps, num_stages=num_stages)
        o, lse, _ = sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                        pool.req_pool_indices, pool.seq_lens, lists, lens, plan, block_size=1,
                                        sm_scale=pool.sm_scale)
        outs.append((o, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    _check(pool, lists, lens, 1, 2, torch.bfloat16)


@pytest.mark.parametrize("width,pairs,block_size,target", [
    (1, 1, 1, 264), (64, 3, 1, 264), (1100, 3, 1, 264), (1100, 256, 1, 264), (70000, 3, 1, 264),
    (4096, 8, 16, 132), (0, 5, 16, 10), (129, 1, 128, 1000),
])
def test_plan_splits_covers_every_entry_with_tile_aligned_spans(width, pairs, block_size, target):
    p = plan_splits(width, pairs, block_size=block_size, target_programs=target)
    assert p.num_splits * p.chunk >= width and p.chunk % p.sub == 0
    assert (p.num_splits - 1) * p.chunk < max(width, 1)  # no span starts past the widest list
    assert p.sub * block_size >= 16
    if width >= p.sub * 4 and pairs * 4 <= target:  # room to split: more than one span
        assert p.num_splits > 1
    assert p.num_splits <= max(1, -(-target // max(pairs, 1)))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="num_splits"):
        SplitPlan(num_splits=0, chunk=64, sub=64)
    with pytest.raises(ValueError, match="chunk"):
        SplitPlan(num_splits=1, chunk=96, sub=64)
    with pytest.raises(ValueError, match="num_warps"):
        SplitPlan(num_splits=1, chunk=64, sub=64, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        SplitPlan(num_splits=1, chunk=64, sub=64, num_stages=0)
    with pytest.raises(ValueError, match="target_programs"):
        plan_splits(10, 1, block_size=1, target_programs=0)
    pool = make_pool([20], 9, 3, 64, torch.float16, 1, seed=1)
    lists, lens = _lists([20], 3, 1, 20, seed=2)
    small_o, small_lse = alloc_split_buffers(1, 9, 64, 1, "cpu")
    with pytest.raises(ValueError, match="partial_o_buf"):
        sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                            pool.seq_lens, lists, lens, SplitPlan(2, 64, 64), block_size=1, sm_scale=pool.sm_scale,
                            partial_o_buf=small_o, partial_lse_buf=small_lse)
    with pytest.raises(ValueError, match="block_size"):
        sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                            pool.seq_lens, lists, lens, SplitPlan(1, 64, 64), block_size=3, sm_scale=pool.sm_scale)


# ------------------------------------------------------------------ GPU


def _cuda_pool(seq_lens, hq, hk, d, dtype, block_size, seed):
    return make_pool(seq_lens, hq, hk, d, dtype, block_size, seed=seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d,dtype,block_size,width", [
    (9, 3, 64, torch.bfloat16, 1, 1100),
    (9, 3, 64, torch.float16, 1, 300),
    (32, 8, 128, torch.bfloat16, 1, 2048),
    (32, 8, 128, torch.float16, 16, 64),
    (32, 4, 128, torch.bfloat16, 16, 40),
])
def test_gpu_split_decode_matches_reference(hq, hk, d, dtype, block_size, width):
    seq_lens = [2500, 777, 1601] if block_size == 1 else [70 * block_size + 3, 9 * block_size - 5, 40 * block_size]
    pool = _cuda_pool(seq_lens, hq, hk, d, dtype, block_size, seed=31)
    lists, lens = _lists(seq_lens, hk, block_size, width, seed=32, device="cuda")
    for splits in (1, 5, plan_splits(width, len(seq_lens) * hk, block_size=block_size, target_programs=264).num_splits):
        _check(pool, lists, lens, block_size, splits, dtype)


@pytest.mark.gpu
def test_gpu_split_decode_cuda_graph_replay_follows_new_lists():
    """Captured once with preallocated buffers, replayed after the lists / lengths / queries changed in place:
    the replay equals an eager call on the new inputs."""
    seq_lens = [3000, 1200]
    pool = _cuda_pool(seq_lens, 9, 3, 64, torch.bfloat16, 1, seed=41)
    lists, lens = _lists(seq_lens, 3, 1, 1024, seed=42, device="cuda")
    plan = plan_splits(1024, 6, block_size=1, target_programs=264)
    po, plse = alloc_split_buffers(2, 9, 64, plan.num_splits, "cuda")
    out = torch.empty_like(pool.q)
    lse = torch.empty(2, 9, dtype=torch.float32, device="cuda")
    nread = torch.empty(2, 3, dtype=torch.int32, device="cuda")

    def step():
        sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                            pool.seq_lens, lists, lens, plan, block_size=1, sm_scale=pool.sm_scale,
                            partial_o_buf=po, partial_lse_buf=plse, out=out, lse_out=lse, nread_out=nread)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lists, new_lens = _lists(seq_lens, 3, 1, 1024, seed=43, device="cuda")
    lists.copy_(new_lists)
    lens.copy_(new_lens)
    pool.q.copy_(torch.randn_like(pool.q))
    graph.replay()
    torch.cuda.synchronize()
    eo, else_, en = sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                        pool.req_pool_indices, pool.seq_lens, lists, lens, plan, block_size=1,
                                        sm_scale=pool.sm_scale)
    assert torch.equal(out, eo) and torch.equal(nread, en)
    torch.testing.assert_close(lse, else_)
