"""Contract: Triton line estimation (vs_estimate) equals its fp32 reference, per KV head (group-summed)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.reference import vs_estimate_reference
from flashinfer_ext.loopserve.vs_estimate import vs_estimate

from .kv_pool import make_pool


def _rows(seq_len, prefix_len, n_rows, seed):
    """Distinct sampled positions of the segment, always including the last ones (unsorted on purpose)."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.arange(prefix_len, seq_len)
    last = seg[-min(4, len(seg)):]
    rest = seg[:-len(last)]
    pick = rest[torch.randperm(len(rest), generator=g)[: max(0, n_rows - len(last))]]
    return torch.cat([pick, last])[torch.randperm(min(n_rows, len(seg)), generator=g)]


@pytest.mark.parametrize("hq,hk,d,dtype,page,seq_len,prefix_len,n_rows", [
    (4, 1, 64, torch.bfloat16, 16, 77, 30, 9),
    (9, 3, 64, torch.float16, 1, 130, 0, 20),
    (9, 3, 128, torch.bfloat16, 16, 95, 60, 35),
    (8, 8, 128, torch.float16, 32, 64, 63, 1),
])
@pytest.mark.parametrize("split_keys", [None, 32], ids=["one_pass_lse", "lse_in_key_spans"])
def test_vs_estimate_matches_reference(hq, hk, d, dtype, page, seq_len, prefix_len, n_rows, split_keys):
    """Also with the LSE pass in key spans (as long contexts run it: spans of >= split_keys keys)."""
    pool = make_pool([seq_len], hq, hk, d, dtype, page, seed=3)
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    pos = _rows(seq_len, prefix_len, n_rows, seed=4)
    q = torch.randn(len(pos), hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = vs_estimate(q, pos, pool.k_buffer, slots, seq_len, sm_scale=d ** -0.5, block_n=32,
                      min_split_keys=split_keys)
    ref = vs_estimate_reference(q, pos, pool.k_buffer, slots, seq_len, d ** -0.5)
    for got, want in zip((out.v_sum, out.v_max, out.s_sum, out.s_max), ref):
        assert got.shape == (hk, seq_len) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    group = hq // hk
    # every sampled row of every query head carries mass 1: per KV head G * R, on both line families
    torch.testing.assert_close(out.v_sum.sum(1), torch.full((hk,), float(group * len(pos))), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.s_sum.sum(1), torch.full((hk,), float(group * len(pos))), rtol=1e-5, atol=1e-4)
    # causal: no mass on keys after the last sampled row, no slash offset beyond the last position
    assert float(out.v_sum[:, int(pos.max()) + 1:].abs().sum()) == 0.0
    assert out.group_size == group and out.num_rows == len(pos)


def test_vs_estimate_rejects_bad_shapes():
    pool = make_pool([32], 6, 4, 64, torch.float16, 16, seed=1)
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    with pytest.raises(ValueError, match="num_qo_heads=6"):
        vs_estimate(torch.zeros(2, 6, 64, dtype=torch.float16), torch.tensor([30, 31]), pool.k_buffer, slots, 32,
                    sm_scale=0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_gpu_vs_estimate_llama_shapes(seq_len):
    """Llama-3.1-8B shapes (32/8 heads, d=128, bf16), 64 sampled rows incl. the last 16."""
    pool = make_pool([seq_len], 32, 8, 128, torch.bfloat16, 1, seed=11, device="cuda")
    slots = pool.req_to_token[pool.req_pool_indices[0].long()]
    pos = _rows(seq_len, seq_len // 2, 64, seed=12).cuda()
    q = torch.randn(64, 32, 128, device="cuda").to(torch.bfloat16)
    out = vs_estimate(q, pos, pool.k_buffer, slots, seq_len, sm_scale=128 ** -0.5)
    ref = vs_estimate_reference(q.cpu(), pos.cpu(), pool.k_buffer.cpu(), slots.cpu(), seq_len, 128 ** -0.5)
    for got, want in zip((out.v_sum, out.v_max, out.s_sum, out.s_max), ref):
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=1e-4)
