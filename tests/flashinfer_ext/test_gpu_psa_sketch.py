"""GPU contracts of PSA's int4 key sketch (marker ``gpu``; skipped without CUDA): the compiled sketch write, block
masses and shares = their fp32 reference; the wrapper with criticality / estimator 'sketch' stops where the reference
stop test does on its own ranking; a CUDA graph captured over the sketch path replays as eager after plan()."""

from __future__ import annotations

import pytest
import torch

from .graph_check import assert_graph_replay_matches_eager
from .kv_pool import make_pool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SKETCH = dict(criticality="sketch", estimator="sketch")


def _sketch(pool, block_size, cfg, max_batch_size=None, **wkw):
    from flashinfer_ext.psa.block_meta import paged_block_table
    from flashinfer_ext.psa.decode import PsaDecodeWrapper
    from flashinfer_ext.psa.key_sketch import KeySketchPool

    hq, d = pool.q.shape[1], pool.q.shape[2]
    hk, batch = pool.k_buffer.shape[1], pool.q.shape[0]
    nb = -(-pool.req_to_token.shape[1] // block_size)
    table = paged_block_table(pool.req_to_token, pool.req_pool_indices, pool.page_size, nb)
    sp = KeySketchPool(1, pool.k_buffer.shape[0] // pool.page_size, hk, d, block_size, device="cuda")
    zero = torch.zeros(batch, dtype=torch.int32, device="cuda")
    sp.update(0, pool.k_buffer, pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, nb)
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=block_size,
                         max_batch_size=max_batch_size or batch, max_blocks_per_req=nb, device="cuda",
                         out_dtype=pool.q.dtype, **wkw)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    return w, sp, table, nb


@pytest.mark.parametrize("hq,hk,d,dtype,page", [(32, 8, 128, torch.bfloat16, 16), (9, 3, 64, torch.float16, 16),
                                                 (9, 3, 64, torch.bfloat16, 32)])
def test_gpu_sketch_passes_and_stop_test_match_reference(hq, hk, d, dtype, page):
    from flashinfer_ext.common.reference import progressive_decode_reference
    from flashinfer_ext.psa.config import PsaDecodeConfig
    from flashinfer_ext.psa.key_sketch import quantize_keys_reference, sketch_scores_reference

    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=4, sink_blocks=1, local_blocks=2, **SKETCH)
    seq_lens = [300 * page + 5, 41 * page, 120 * page + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page, seed=7, planted=True, device="cuda")
    w, sp, table, nb = _sketch(pool, page, cfg)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    codes, scales = sp.layer(0)
    # the written sketch of request 0's first block equals the reference quantization
    slots = pool.req_to_token[int(pool.req_pool_indices[0]), :page].long()
    rc, rs = quantize_keys_reference(pool.k_buffer[slots].cpu())
    c = codes[int(table[0, 0])].cpu().to(torch.int32)
    got = torch.cat([(c & 15) - 8, (c >> 4) - 8], -1).transpose(0, 1)  # [page, hk, d]
    assert torch.equal(got, rc.to(torch.int32)) and torch.equal(scales[int(table[0, 0])].cpu().t(), rs)
    r_scores, r_tot, _ = sketch_scores_reference(pool.q.cpu(), pool.k_buffer.cpu(), pool.req_to_token.cpu(),
                                                 pool.req_pool_indices.cpu(), pool.seq_lens.cpu(), block_size=page,
                                                 sm_scale=pool.sm_scale, num_blocks=nb, sink_blocks=1, local_blocks=2)
    scores = w._views()[0].cpu()
    fin = torch.isfinite(r_scores)
    torch.testing.assert_close(scores[fin], r_scores[fin], rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(w._tot_buf[: r_tot.numel()].cpu().view_as(r_tot), r_tot, rtol=1e-4, atol=2e-3)
    n_blocks = ((pool.seq_lens + page - 1) // page).cpu()
    nf = torch.clamp(n_blocks, max=3).to(torch.int32)
    lens = torch.minimum(n_blocks, nf + cfg.max_blocks).to(torch.int32)[:, None].expand(-1, hk).contiguous()
    order = w.order.cpu()
    ro, rlse, rnread, _ = progressive_decode_reference(
        pool.q.cpu(), pool.k_buffer.cpu(), pool.v_buffer.cpu(), pool.req_to_token.cpu(), pool.req_pool_indices.cpu(),
        pool.seq_lens.cpu(), order, lens, nf, block_size=page, sm_scale=pool.sm_scale, epsilon=[0.9] * 3,
        micro_batch_blocks=4, chunk_ends=cfg.ranked_chunk_ends(nb), estimator="sketch",
        sorted_scores=torch.gather(r_scores, 2, order), calib_slack=cfg.calib_slack, return_kept_est=True,
        sketch_totals=r_tot)
    same = nread.cpu() == rnread  # fp32 summation order may flip a stop decision at the threshold edge
    assert same.float().mean().item() >= 0.98
    assert bool((nread.cpu() < lens).any())
    mask = same.repeat_interleave(hq // hk, dim=1)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float().cpu()[mask], ro[mask], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu()[mask], rlse[mask], rtol=1e-4, atol=2e-3)


def test_gpu_sketch_cuda_graph_replay_matches_eager():
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=0.95, **SKETCH)
    pool = make_pool([2048 + 3, 4096, 1000], 9, 3, 64, torch.bfloat16, 16, seed=9, planted=True, device="cuda",
                     max_context_len=4096 + 16)
    w, sp, table, nb = _sketch(pool, 16, cfg, max_batch_size=4)
    assert_graph_replay_matches_eager(w, pool, sp.layer(0), table)
