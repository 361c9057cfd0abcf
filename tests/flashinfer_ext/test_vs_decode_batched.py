"""Contract: LoopServe's batched decode (Alg. 3) — the union mask of stored vertical lines, slash offsets
relative to the current position, top-B, sink and tokens since the last selection
(:func:`flashinfer_ext.common.sparse_decode.decode_union_mask`), compacted by prefix sums
(:func:`~flashinfer_ext.common.sparse_decode.mask_to_lists`) and attended in one :func:`sparse_decode` launch
over all rows and KV heads — equals the fp32 masked decode over the same sets, for GQA 4/1, 3/1 and 4/1 at
Llama shapes, bf16 and fp16, page sizes 1/16 (partial last pages), rows of different lengths; and the
context-independent list construction the server uses (:func:`~flashinfer_ext.common.sparse_decode.decode_union_lists`:
concat + sort + dedupe, O(width) per row) gives exactly the mask's compacted lists."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.reference import masked_decode_reference
from flashinfer_ext.common.sparse_decode import (decode_union_lists, decode_union_mask, lists_to_mask, mask_to_lists,
                                          sparse_decode)

from .kv_pool import make_pool

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _sets(seq_lens, hk, seed, device, wv=9, ws=7, wb=11):
    """Random per-(row, KV head) lines / offsets / top-B (-1 padded) and positions, since."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    n = max(seq_lens)
    v = torch.randint(0, n, (b, hk, wv), generator=g)
    s = torch.randint(0, n, (b, hk, ws), generator=g)
    tb = torch.randint(0, n, (b, hk, wb), generator=g)
    for t in (v, s, tb):
        t[torch.rand(t.shape, generator=g) < 0.2] = -1
    seq = torch.tensor(seq_lens)
    since = seq - torch.randint(1, 6, (b,), generator=g)
    return [x.to(torch.int32).to(device) for x in (v, s, tb)] + [(seq - 1).to(device), since.to(device),
                                                                   seq.to(torch.int32).to(device)]


def _python_set(v, s, tb, pos, since, seq, sink):
    out = {int(x) for x in v if x >= 0} | {pos - int(x) for x in s if x >= 0 and pos - x >= 0}
    out |= {int(x) for x in tb if x >= 0} | set(range(sink)) | set(range(since, seq))
    return {x for x in out if x < seq}


def _check(seq_lens, hq, hk, d, dtype, page, device, seed=0):
    pool = make_pool(seq_lens, hq, hk, d, dtype, page, seed=seed, device=device)
    v, s, tb, pos, since, seq = _sets(seq_lens, hk, seed + 1, device)
    mask = decode_union_mask(v, s, tb, pos, since, seq, sink_tokens=4, max_len=max(seq_lens))
    for b in range(len(seq_lens)):
        for h in range(hk):
            want = _python_set(v[b, h].tolist(), s[b, h].tolist(), tb[b, h].tolist(), int(pos[b]), int(since[b]),
                               int(seq[b]), 4)
            assert set(torch.nonzero(mask[b, h]).flatten().tolist()) == want
    lists, lens = mask_to_lists(mask)
    assert torch.equal(lens, mask.sum(2, dtype=torch.int32))
    for b in range(len(seq_lens)):
        for h in range(hk):
            assert lists[b, h, : lens[b, h]].tolist() == torch.nonzero(mask[b, h]).flatten().tolist()
    lists, lens = _union_lists_checked(v, s, tb, pos, since, seq, mask)
    o, lse, nread = sparse_decode(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                  pool.seq_lens, lists, lens, torch.zeros(len(seq_lens), dtype=torch.int32,
                                                                          device=device),
                                  block_size=1, sm_scale=pool.sm_scale, epsilon=1.0)
    ref = masked_decode_reference(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                  mask, pool.sm_scale)
    assert torch.equal(nread, lens)
    torch.testing.assert_close(o.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def _union_lists_checked(v, s, tb, pos, since, seq, mask, sink=4):
    """decode_union_lists equals the mask's compaction entry for entry (lens, then the valid prefix)."""
    max_since = int((seq.long() - since.long()).max())
    lists, lens = decode_union_lists(v, s, tb, pos, since, seq, sink_tokens=sink, max_since=max_since)
    want_lists, want_lens = mask_to_lists(mask)
    assert lists.shape[2] == v.shape[2] + s.shape[2] + tb.shape[2] + sink + max_since
    assert torch.equal(lens, want_lens)
    valid = torch.arange(lists.shape[2], device=lists.device)[None, None, :] < lens[:, :, None]
    w = lists.shape[2]
    want = torch.nn.functional.pad(want_lists, (0, max(0, w - want_lists.shape[2])))[:, :, :w]
    assert torch.equal(torch.where(valid, lists, 0), want * valid)
    assert torch.equal(lists_to_mask(lists, lens, mask.shape[2]), mask)
    return lists, lens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_lens,hk", [([1, 2, 300], 3), ([64, 65], 1), ([1000, 17, 513, 5], 8)])
def test_union_lists_equal_the_compacted_union_mask(seq_lens, hk, seed):
    # duplicates across the sources (a slash hitting a vertical line, top-B inside the sink or the tail),
    # entries past a row's length, empty sources (all -1), rows shorter than the sink
    v, s, tb, pos, since, seq = _sets(seq_lens, hk, seed, "cpu", wv=13, ws=5, wb=17)
    g = torch.Generator().manual_seed(100 + seed)
    if seed % 3 == 0:
        tb[:, :, :4] = v[:, :, :4]                            # exact duplicates of vertical lines
        s[:, :, 0] = pos[:, None] - v[:, :, 0].clamp(min=0)   # a slash landing on a vertical line
    if seed % 3 == 1:
        v.fill_(-1)                                           # no stored lines at all
    if seed % 2:
        since = (seq - torch.randint(1, 40, (len(seq_lens),), generator=g)).clamp(min=0)
    mask = decode_union_mask(v, s, tb, pos, since, seq, sink_tokens=4, max_len=max(seq_lens))
    _union_lists_checked(v, s, tb, pos, since, seq, mask)


@pytest.mark.parametrize("seq_lens,hq,hk,d,dtype,page", [
    ([50, 77, 33], 4, 1, 64, torch.bfloat16, 16),     # partial last pages, rows of different lengths
    ([61, 40], 9, 3, 64, torch.float16, 1),           # SmolLM2 GQA 3, page size 1
    ([45], 8, 2, 128, torch.bfloat16, 16),
])
def test_batched_decode_union_matches_fp32_reference(seq_lens, hq, hk, d, dtype, page):
    _check(seq_lens, hq, hk, d, dtype, page, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens,hq,hk,page", [
    ([5000, 9001, 777, 4096], 32, 8, 16),    # Llama-3.1-8B shapes, partial pages
    ([3001, 1500], 9, 3, 1),                  # SmolLM2 shapes, page size 1
])
def test_gpu_batched_decode_union_matches_fp32_reference(seq_lens, hq, hk, page, dtype):
    _check(seq_lens, hq, hk, 128 if hq == 32 else 64, dtype, page, "cuda", seed=5)
