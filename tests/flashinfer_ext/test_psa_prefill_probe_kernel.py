"""Contract (CPU, Triton interpreter): the kernel runner's prefill probe (``PsaCudaRunner`` of ``--sparse psa``)
counts, per layer, the blocks PSA's stop test reads for a long prompt's last query, over block metadata built for
the whole context in the same extend (the server-level contract is in ``tests/test_psa_prefill_probe.py``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_sparse.psa.cuda_runner import PsaCudaRunner
from sglang_sparse.psa.runner import AttnShape
from sglang_sparse.psa.switch import _PREFILL_PROBE_ATTR
from sglang_sparse.psa.stats import COL_READ, COL_SPARSE, COL_TOTAL, ROW_PREFILL_PROBE
from tests.test_psa_prefill_probe import BLOCK, D, HK, HQ, LAYERS, _cfg, _extend, _req


def _pool(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = 256 * len(lens)
    k = [torch.randn(slots, HK, D, generator=g).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(slots, HK, D, generator=g).bfloat16() for _ in range(LAYERS)]
    rtt = torch.arange(slots, dtype=torch.int32).view(len(lens), 256)
    pool = SimpleNamespace(get_key_buffer=lambda lid: k[lid], get_value_buffer=lambda lid: v[lid])
    return pool, rtt, k, v


@pytest.mark.parametrize("eps,page", [(0.6, BLOCK), (0.95, BLOCK), (0.95, 1)])
def test_kernel_runner_counts_the_reads_of_the_last_prompt_query(eps, page):
    """PsaCudaRunner (Triton interpreter on CPU): per layer, metadata over the whole context, then the stop test for
    the probe row's last query; the prefill row's blocks_read is the reference's count for that query within a few
    blocks (the kernel ranks by quantised keys), the short row is not touched."""
    from flashinfer_ext.common.reference import psa_decode_reference

    cfg = _cfg(epsilon=eps)
    lens, ext = [200, 60], [30, 60]
    pool, rtt, k, v = _pool(lens)
    runner = PsaCudaRunner(cfg, BLOCK, AttnShape(LAYERS, HQ, HK, D), torch.device("cpu"), token_to_kv_pool=pool,
                           req_to_token=rtt, max_batch_size=2, sm_scale=D ** -0.5, out_dtype=torch.bfloat16,
                           page_size=page)
    long_req, short_req = _req(200), _req(60)
    long_req.req_pool_idx, short_req.req_pool_idx = 0, 1  # page 1: metadata rows of the probe row's slot
    fb = _extend(lens, ext, [long_req, short_req])
    runner.begin_batch(None, fb)
    assert getattr(long_req, _PREFILL_PROBE_ATTR, False) and not getattr(short_req, _PREFILL_PROBE_ATTR, False)
    g = torch.Generator().manual_seed(1)
    want = 0
    for lid in range(LAYERS):
        q = torch.randn(sum(ext), HQ * D, generator=g).bfloat16()
        layer = SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, head_dim=D, scaling=D ** -0.5)
        runner.after_extend(None, q, layer, fb)
        kcfg = dataclasses.replace(runner.kernel_cfg, epsilon=eps)
        _, _, nread, _ = psa_decode_reference(q.view(-1, HQ, D)[29:30], k[lid], v[lid], rtt, torch.tensor([0]),
                                              torch.tensor([200]), kcfg, block_size=BLOCK, sm_scale=D ** -0.5)
        want += int(nread.sum())
    rows = runner.step_rows
    assert rows[0, COL_SPARSE] == ROW_PREFILL_PROBE and rows[0, COL_TOTAL] == 13 * LAYERS * HK
    assert abs(float(rows[0, COL_READ]) - want) <= 2 * LAYERS * HK, (float(rows[0, COL_READ]), want)
    assert 0 < float(rows[0, COL_READ]) <= float(rows[0, COL_TOTAL])
    assert rows[1, COL_SPARSE] == 0 and rows[1, COL_READ] == 0
    if page == 1:  # the probe row's slot holds rows for its 13 blocks, the short row's none
        assert len(runner.rows.rows_of(0)) == 13 and runner.rows.rows_of(1) == []
