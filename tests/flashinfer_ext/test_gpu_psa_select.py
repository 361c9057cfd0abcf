"""GPU contracts of PSA's 'select' schedule (marker ``gpu``; skipped without CUDA): the compiled selection = its fp64
reference on the same masses, the wrapper = exact attention over its lists, and a CUDA graph captured over the
schedule replays as eager after plan()."""

from __future__ import annotations

import pytest
import torch

from .graph_check import assert_graph_replay_matches_eager
from .kv_pool import make_pool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SELECT = dict(criticality="sketch", estimator="sketch", schedule="select")


def _select(pool, block_size, cfg, max_batch_size=None):
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
                         out_dtype=pool.q.dtype)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    return w, sp, table, nb


@pytest.mark.parametrize("hq,hk,d,dtype,page", [(32, 8, 128, torch.bfloat16, 16), (9, 3, 64, torch.float16, 16),
                                                 (9, 3, 64, torch.bfloat16, 32)])
def test_gpu_select_matches_reference_selection_and_exact_attention(hq, hk, d, dtype, page):
    from flashinfer_ext.common.reference import kept_mass_reference
    from flashinfer_ext.psa.config import PsaDecodeConfig
    from flashinfer_ext.psa.sketch_select import sketch_select_reference

    cfg = PsaDecodeConfig(epsilon=0.9, sink_blocks=1, local_blocks=2, **SELECT)
    seq_lens = [300 * page + 5, 41 * page, 120 * page + 1]
    pool = make_pool(seq_lens, hq, hk, d, dtype, page, seed=7, planted=True, device="cuda")
    w, sp, table, nb = _select(pool, page, cfg)
    o, lse, nread = w.run(pool.q, pool.k_buffer, pool.v_buffer, *sp.layer(0))
    bs = len(seq_lens)
    mass = w._mass_buf[: bs * hk * (hq // hk) * nb].view(bs, hk, hq // hk, nb).cpu()
    lists, kept = sketch_select_reference(mass, pool.seq_lens.cpu(), [0.9] * bs, w._list_lens_buf[:bs].cpu(),
                                          block_size=page, sink_blocks=1, local_blocks=2, calib_slack=cfg.calib_slack)
    nread_h, order = nread.cpu(), w.order.cpu()
    same = [order[r, h, : int(nread_h[r, h])].tolist() == lists[r][h] for r in range(bs) for h in range(hk)]
    assert sum(same) >= 0.95 * len(same)  # fp32 sums may move one block across a bin edge
    n_blocks = ((pool.seq_lens + page - 1) // page).cpu()
    assert bool((nread_h < n_blocks[:, None]).any())
    # the output is exact attention over the selected blocks
    kept_true = kept_mass_reference(pool.q.cpu(), pool.k_buffer.cpu(), pool.req_to_token.cpu(),
                                    pool.req_pool_indices.cpu(), pool.seq_lens.cpu(), order, nread_h, block_size=page,
                                    sm_scale=pool.sm_scale)
    assert float(kept_true.min()) >= 0.9
    from flashinfer_ext.common.reference import _sketch_select_attend  # noqa: PLC0415 (the reference's attend step)
    ro, rlse, rn, _ = _sketch_select_attend(pool.q.cpu(), pool.k_buffer.cpu(), pool.v_buffer.cpu(),
                                            pool.req_to_token.cpu(), pool.req_pool_indices.cpu(), pool.seq_lens.cpu(),
                                            cfg, mass, [0.9] * bs, w._list_lens_buf[:bs].cpu(), block_size=page,
                                            sm_scale=pool.sm_scale, return_kept_est=False)
    mask = torch.tensor(same).view(bs, hk).repeat_interleave(hq // hk, dim=1)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(o.float().cpu()[mask], ro[mask], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu()[mask], rlse[mask], rtol=1e-4, atol=2e-3)


def test_gpu_select_cuda_graph_replay_matches_eager():
    from flashinfer_ext.psa.config import PsaDecodeConfig

    cfg = PsaDecodeConfig(epsilon=0.95, **SELECT)
    pool = make_pool([2048 + 3, 4096, 1000], 9, 3, 64, torch.bfloat16, 16, seed=9, planted=True, device="cuda",
                     max_context_len=4096 + 16)
    w, sp, table, nb = _select(pool, 16, cfg, max_batch_size=4)
    assert_graph_replay_matches_eager(w, pool, sp.layer(0), table)
