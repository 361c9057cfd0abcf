"""Contract: the batched vertical sums (vertical_sums_batched) equal their fp32 reference and, per request,
the single-request vs_estimate's v_sum (0 past each request's length), for several requests of different
lengths (partial last key blocks) and row counts, GQA 4/1, 9/3, 2/2, bf16/fp16; decode_topb_batched selects,
per request, the same set as decode_topb and never a position >= its length."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.vs_estimate import VSLineSums, vs_estimate
from flashinfer_ext.loopserve.vs_estimate_batched import (decode_topb_batched, qo_indptr_of, vertical_sums_batched,
                                                vertical_sums_batched_reference)
from flashinfer_ext.loopserve.vs_select import decode_topb

from .kv_pool import make_pool


def _batch(seq_lens, n_rows, seed, device="cpu"):
    """Observation rows of each request (distinct positions ending at its last one, as decode has),
    concatenated: (q_pos [R_total] int64, q_req [R_total] int32)."""
    g = torch.Generator().manual_seed(seed)
    pos, req = [], []
    for b, (n, r) in enumerate(zip(seq_lens, n_rows)):
        pick = torch.randperm(n - 1, generator=g)[: r - 1].sort().values
        pos.append(torch.cat([pick, torch.tensor([n - 1])]))
        req.append(torch.full((r,), b, dtype=torch.int32))
    pos, req = torch.cat(pos), torch.cat(req)
    return pos.to(device), req.to(device)


CASES = [
    # hq, hk, d, dtype, page, seq_lens, rows per request
    (4, 1, 64, torch.bfloat16, 16, [77, 130, 33], [16, 5, 1]),
    (9, 3, 64, torch.float16, 1, [130, 64, 97], [7, 16, 12]),
    (2, 2, 128, torch.bfloat16, 16, [200, 45], [3, 16]),
]


@pytest.mark.parametrize("hq,hk,d,dtype,page,seq_lens,n_rows", CASES)
def test_vertical_sums_batched_matches_reference_and_single_request(hq, hk, d, dtype, page, seq_lens, n_rows):
    pool = make_pool(seq_lens, hq, hk, d, dtype, page, seed=7)
    pos, req = _batch(seq_lens, n_rows, seed=8)
    q = torch.randn(len(pos), hq, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    max_len = max(seq_lens) + 5  # wider than any request: the tail must be 0
    seq = pool.seq_lens
    out = vertical_sums_batched(q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, seq, max_len,
                                sm_scale=d ** -0.5, block_n=32, max_qo_len=max(n_rows))
    ref = vertical_sums_batched_reference(q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                          seq, max_len, sm_scale=d ** -0.5)
    assert out.shape == (len(seq_lens), hk, max_len) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for b, (n, r) in enumerate(zip(seq_lens, n_rows)):
        rows = req == b
        slots = pool.req_to_token[pool.req_pool_indices[b].long()]
        single = vs_estimate(q[rows], pos[rows], pool.k_buffer, slots, n, sm_scale=d ** -0.5, block_n=32)
        torch.testing.assert_close(out[b, :, :n], single.v_sum, rtol=1e-4, atol=1e-5)
        assert float(out[b, :, n:].abs().sum()) == 0.0
        # each row of each query head carries mass 1: per KV head G * rows
        torch.testing.assert_close(out[b].sum(1), torch.full((hk,), float(hq // hk * r)), rtol=1e-5, atol=1e-4)


def test_vertical_sums_batched_writes_into_out_and_takes_qo_indptr_and_lse_buf():
    seq_lens, n_rows = [50, 70], [4, 6]
    pool = make_pool(seq_lens, 4, 2, 64, torch.float16, 1, seed=2)
    pos, req = _batch(seq_lens, n_rows, seed=3)
    q = torch.randn(len(pos), 4, 64).to(torch.float16)
    out_buf = torch.full((2, 2, 80), float("nan"))
    indptr = qo_indptr_of(req, 2)
    assert indptr.tolist() == [0, 4, 10]
    got = vertical_sums_batched(q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                pool.seq_lens, 72, sm_scale=0.125, out=out_buf, qo_indptr=indptr,
                                lse_buf=torch.full((4, 12), float("nan")))
    assert got.data_ptr() == out_buf.data_ptr() and got.shape == (2, 2, 72)
    ref = vertical_sums_batched_reference(q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                          pool.seq_lens, 72, sm_scale=0.125)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)  # every entry written (no NaN left)


def test_vertical_sums_batched_rejects_bad_heads():
    pool = make_pool([32], 6, 4, 64, torch.float16, 16, seed=1)
    with pytest.raises(ValueError, match="num_qo_heads=6"):
        vertical_sums_batched(torch.zeros(1, 6, 64, dtype=torch.float16), torch.tensor([31]),
                              torch.tensor([0]), pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                              pool.seq_lens, 32, sm_scale=0.125)


@pytest.mark.parametrize("budgets", [[8, 8, 8], [3, 200, 40]])
def test_decode_topb_batched_equals_per_request_decode_topb_and_stays_below_seq_len(budgets):
    g = torch.Generator().manual_seed(4)
    seq_lens = [30, 100, 64]
    hk, n = 3, 110
    v = torch.rand(len(seq_lens), hk, n, generator=g)
    for b, s in enumerate(seq_lens):
        v[b, :, s:] = 10.0  # large scores past the end must never be picked
    width = max(min(bb, s) for bb, s in zip(budgets, seq_lens))
    lists = decode_topb_batched(v, torch.tensor(budgets, dtype=torch.int32), torch.tensor(seq_lens), width)
    assert lists.shape == (len(seq_lens), hk, width) and lists.dtype == torch.int32
    for b, (bb, s) in enumerate(zip(budgets, seq_lens)):
        keep = min(bb, s)
        want, _ = decode_topb(VSLineSums(v[b, :, :s], v[b, :, :s], v[b, :, :s], v[b, :, :s], 1, 1), bb)
        for h in range(hk):
            got = lists[b, h].tolist()
            assert all(x == -1 for x in got[keep:])
            assert set(got[:keep]) == set(want[h].tolist())
            assert all(0 <= x < s for x in got[:keep])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_splits,key_blocks", [(1, 1), (4, 8)])
@pytest.mark.parametrize("hq,hk,seq_lens", [(32, 8, [8192, 300, 4097, 2048]), (9, 3, [130, 2700, 1500, 700])])
def test_gpu_vertical_sums_batched_matches_reference(hq, hk, seq_lens, num_splits, key_blocks):
    """Llama-3.1-8B (32/8) and SmolLM2-135M (9/3) head layouts, bf16, decode-like rows (16 per request), the
    LSE pass whole and split into 4 key spans, one and 8 key blocks per program of the sums pass."""
    d = 128 if hq == 32 else 64
    pool = make_pool(seq_lens, hq, hk, d, torch.bfloat16, 1, seed=11, device="cuda")
    pos, req = _batch(seq_lens, [16] * len(seq_lens), seed=12, device="cuda")
    q = torch.randn(len(pos), hq, d, device="cuda").to(torch.bfloat16)
    max_len = max(seq_lens)
    out = vertical_sums_batched(q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices,
                                pool.seq_lens, max_len, sm_scale=d ** -0.5, max_qo_len=16, num_splits=num_splits,
                                key_blocks=key_blocks)
    ref = vertical_sums_batched_reference(q.cpu(), pos.cpu(), req.cpu(), pool.k_buffer.cpu(),
                                          pool.req_to_token.cpu(), pool.req_pool_indices.cpu(),
                                          pool.seq_lens.cpu(), max_len, sm_scale=d ** -0.5)
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=1e-4)
    budgets = torch.tensor([1024] * len(seq_lens), dtype=torch.int32, device="cuda")
    lists = decode_topb_batched(out, budgets, pool.seq_lens, min(1024, max_len))
    for b, s in enumerate(seq_lens):
        got = lists[b].cpu()
        assert bool(((got == -1) | ((got >= 0) & (got < s))).all())
        assert int((got >= 0).sum()) == hk * min(1024, s)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("hq,hk,d,dtype,page,seq_lens,n_rows", CASES)
def test_vertical_sums_batched_split_lse_equals_the_unsplit_pass(hq, hk, d, dtype, page, seq_lens, n_rows,
                                                                  num_splits):
    """The key-split LSE pass (spans of whole key blocks, merged) gives the reference's sums, and spans past a
    short request's end (no key for its rows) do not disturb it; the preallocated span buffer is used."""
    pool = make_pool(seq_lens, hq, hk, d, dtype, page, seed=17)
    pos, req = _batch(seq_lens, n_rows, seed=18)
    q = torch.randn(len(pos), hq, d, generator=torch.Generator().manual_seed(19)).to(dtype)
    max_len = max(seq_lens) + 5
    args = (q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, max_len)
    part = torch.full((2, num_splits, hq, len(pos)), float("nan"))
    split = vertical_sums_batched(*args, sm_scale=d ** -0.5, block_n=32, max_qo_len=max(n_rows),
                                  num_splits=num_splits, lse_part_buf=part)
    whole = vertical_sums_batched(*args, sm_scale=d ** -0.5, block_n=32, max_qo_len=max(n_rows))
    ref = vertical_sums_batched_reference(*args, sm_scale=d ** -0.5)
    torch.testing.assert_close(split, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert not torch.isnan(part[:, :2]).any()  # the first spans were written through the given buffer


def test_vertical_sums_batched_rejects_bad_splits_and_span_buffer():
    seq_lens, n_rows = [100, 70], [4, 6]
    pool = make_pool(seq_lens, 4, 2, 64, torch.float16, 1, seed=2)
    pos, req = _batch(seq_lens, n_rows, seed=3)
    q = torch.randn(len(pos), 4, 64).to(torch.float16)
    args = (q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, 100)
    with pytest.raises(ValueError, match="num_splits=0"):
        vertical_sums_batched(*args, sm_scale=0.125, num_splits=0)
    with pytest.raises(ValueError, match="lse_part_buf must be"):
        vertical_sums_batched(*args, sm_scale=0.125, block_n=32, num_splits=2,
                              lse_part_buf=torch.zeros(2, 1, 4, len(pos)))


def test_lse_splits_fills_the_target_with_long_spans_only():
    from flashinfer_ext.loopserve.vs_lse_split import MAX_LSE_SPLITS, lse_splits

    # 8 requests x 8 KV heads x 1 row block at 32k keys, 264 target programs (H100: 2 x 132 SMs): 4 spans
    assert lse_splits(8, 8, 1, 32768, 264) == 4
    # one request: as many spans as the keys allow (32k / 4096 = 8), a power of two
    assert lse_splits(1, 8, 1, 32768, 264) == 8
    assert lse_splits(1, 8, 1, 1 << 20, 264) == MAX_LSE_SPLITS
    # short contexts (SmolLM2's 2.7k) and batches that already fill the GPU keep the one-pass LSE
    assert lse_splits(1, 3, 1, 2700, 264) == 1
    assert lse_splits(64, 8, 1, 32768, 264) == 1
    assert lse_splits(1, 1, 1, 300, 8, min_split_keys=64) == 4
    from flashinfer_ext.loopserve.vs_common import target_programs_of

    assert target_programs_of(torch.device("cpu")) == 8  # the kernels' default off CUDA (2 x SMs on CUDA)


@pytest.mark.parametrize("key_blocks", [1, 2, 3])
@pytest.mark.parametrize("seq_lens,n_rows", [([77, 130, 33], [16, 5, 1]), ([150, 64], [20, 3])],
                         ids=["one_row_block", "two_row_blocks"])
def test_vertical_sums_batched_with_several_key_blocks_per_program_equals_one_block(seq_lens, n_rows, key_blocks):
    """Programs of the sums pass walking several consecutive key blocks (the rows' queries loaded once when
    every request fits one row block) give exactly the one-block-per-program sums, zeros past each length."""
    hq, hk, d = 4, 1, 64
    pool = make_pool(seq_lens, hq, hk, d, torch.bfloat16, 16, seed=21)
    pos, req = _batch(seq_lens, n_rows, seed=22)
    q = torch.randn(len(pos), hq, d, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    max_len = max(seq_lens) + 40  # wider than any request, and than the last program's blocks
    args = (q, pos, req, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, max_len)
    kw = dict(sm_scale=d ** -0.5, block_n=32, max_qo_len=max(n_rows))
    got = vertical_sums_batched(*args, **kw, key_blocks=key_blocks, out=torch.full((len(seq_lens), hk, max_len),
                                                                                float("nan")))
    one = vertical_sums_batched(*args, **kw, key_blocks=1)
    torch.testing.assert_close(got, one, rtol=1e-6, atol=1e-7)  # one row block: one sum over all packed rows
    ref = vertical_sums_batched_reference(*args, sm_scale=d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_vsum_key_blocks_groups_blocks_only_for_large_grids():
    from flashinfer_ext.loopserve.vs_estimate_batched import vsum_key_blocks

    assert vsum_key_blocks(8 * 8 * 512, 264) == 16     # 8 requests x 32k keys, Llama-8B heads, H100
    assert vsum_key_blocks(1 * 8 * 512, 264) == 2      # one request x 32k keys
    assert vsum_key_blocks(1 * 3 * 43, 264) == 1       # SmolLM2 at 2.7k keys: one block per program, as before
    with pytest.raises(ValueError, match="key_blocks=0"):
        pool = make_pool([40], 4, 1, 64, torch.float16, 16, seed=1)
        vertical_sums_batched(torch.zeros(1, 4, 64, dtype=torch.float16), torch.tensor([39]), torch.tensor([0]),
                              pool.k_buffer, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, 40,
                              sm_scale=0.125, key_blocks=0)
