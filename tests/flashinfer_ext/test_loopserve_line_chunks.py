"""Contract: with ``prefill: "dense"``, LoopServe's ``line_chunks`` decides which chunks of an engaged prompt
estimate and select lines (CPU reference path, SGLang-shaped stand-ins, no sglang import):

* ``all``: every chunk selects over all its keys (candidates counted per chunk);
* ``last``: only the prompt's last chunk selects, and its lines are the ones ``all`` gets from that chunk (a subset
  of ``all``'s union); earlier chunks carry no sampled rows and no selection plan;
* ``none``: no chunk selects; the decode lists start from the sink and local-window lines alone;
* every setting records the prompt's last queries in the observation ring;
* ``auto`` (the default) is ``last`` with the dense prefill and ``all`` with the sparse one;
* ``prefill: "lines"`` with ``last`` or ``none`` is a config error naming the field.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_sparse.config import LoopServeConfig, SparseConfigError
from sglang_sparse.loopserve.runner import STATE_ATTR, LoopServeRunner
from sglang_sparse.loopserve.stats import COL_LTOT, COL_S, COL_V

from .kv_pool import make_pool

L, HQ, HK, D = 2, 4, 2, 64
PROMPT, CHUNK = 300, 100
SINK, LOCAL = 4, 16


def _extend_batch(prefix: int, ext: int, req, pool):
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False, is_extend=lambda: True)
    return SimpleNamespace(forward_mode=mode, batch_size=1, seq_lens_cpu=torch.tensor([prefix + ext]),
                           extend_seq_lens_cpu=[ext], extend_prefix_lens_cpu=[prefix],
                           req_pool_indices_cpu=pool.req_pool_indices.cpu(),
                           sampling_info=SimpleNamespace(sparse_reqs=[req]))


def _prefill(line_chunks: str, seed: int = 0):
    """Run a ``PROMPT``-token prompt through the runner in chunks of ``CHUNK``; the request state after it."""
    pool = make_pool([PROMPT], HQ, HK, D, torch.float32, 1, seed=seed)
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda i: pool.k_buffer, get_value_buffer=lambda i: pool.v_buffer),
        req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token))
    cfg = LoopServeConfig(min_context=64, alpha=0.9, sink_tokens=SINK, local_window=LOCAL, sampled_rows=16,
                          line_chunks=line_chunks)
    shape = SimpleNamespace(num_layers=L, num_kv_heads=HK, num_qo_heads=HQ, head_dim=D)
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=False)
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), origin_input_ids=[0] * PROMPT,
                          req_pool_idx=int(pool.req_pool_indices[0]))
    g = torch.Generator().manual_seed(seed + 7)
    q_all = torch.randn(PROMPT, HQ, D, generator=g)
    planned = []
    for prefix in range(0, PROMPT, CHUNK):
        runner.begin_batch(backend, _extend_batch(prefix, CHUNK, req, pool))
        assert len(runner.ext_rows) == 1
        r = runner.ext_rows[0]
        planned.append((r.sel_plan is not None, int(r.sample.numel()), r.last_chunk))
        q3 = q_all[prefix: prefix + CHUNK]
        o3 = torch.zeros_like(q3)
        for lid in range(L):
            runner.extend(backend, o3, q3, SimpleNamespace(layer_id=lid, scaling=D ** -0.5))
        assert torch.count_nonzero(o3) == 0  # a dense prefill: the stock attention's rows are left as they are
        runner.finish_extend()
    st = getattr(req, STATE_ATTR)
    assert st.prefill_done
    vmask, smask = st.vmask[:, :, :PROMPT].clone(), st.smask[:, :, :PROMPT].clone()
    ring = st.ring.clone()
    st.finalize()
    return st, vmask, smask, ring, planned, q_all


def test_line_chunks_all_selects_in_every_chunk():
    st, vmask, _, _, planned, _ = _prefill("all")
    assert [p[0] for p in planned] == [True, True, True] and all(p[1] > 0 for p in planned)
    # candidates counted per chunk over its whole context: 2 kinds x (100 + 200 + 300) per layer and KV head
    assert int(st.acc[COL_LTOT]) == 2 * L * HK * (100 + 200 + 300)
    assert int(st.acc[COL_V]) >= int(vmask.sum()) > 0  # per-chunk counts add up (a line may recur)


def test_line_chunks_last_selects_only_in_the_prompts_last_chunk_a_subset_of_all():
    st_all, v_all, s_all, _, _, _ = _prefill("all")
    st, v_last, s_last, _, planned, _ = _prefill("last")
    assert planned == [(False, 0, False), (False, 0, False), (True, 16, True)]
    assert int(st.acc[COL_LTOT]) == 2 * L * HK * PROMPT
    assert int(st.acc[COL_V]) == int(v_last.sum()) and int(st.acc[COL_S]) == int(s_last.sum())
    assert v_last.any() and s_last.any()
    assert not (v_last & ~v_all).any() and not (s_last & ~s_all).any()
    assert int(v_last.sum() + s_last.sum()) < int(v_all.sum() + s_all.sum())
    assert v_last[:, :, :SINK].all() and s_last[:, :, :LOCAL].all()  # the always-attended lines


def test_line_chunks_none_keeps_only_the_sink_and_local_window():
    st, vmask, smask, _, planned, _ = _prefill("none")
    assert all(p[:2] == (False, 0) for p in planned)
    assert int(st.acc[COL_LTOT]) == 0 and int(st.acc[COL_V]) == 0
    assert vmask[:, :, :SINK].all() and not vmask[:, :, SINK:].any()
    assert smask[:, :, :LOCAL].all() and not smask[:, :, LOCAL:].any()
    v_idx, v_cnt, s_idx, s_cnt = st.lines
    assert (v_cnt == SINK).all() and (s_cnt == LOCAL).all()


@pytest.mark.parametrize("line_chunks", ["all", "last", "none"])
def test_every_line_chunks_setting_records_the_prompts_last_queries_in_the_ring(line_chunks):
    _, _, _, ring, _, q_all = _prefill(line_chunks)
    n_ring = ring.shape[1]  # n_d
    pos = torch.arange(PROMPT - n_ring, PROMPT)
    torch.testing.assert_close(ring[0, pos % n_ring], q_all[pos])
    torch.testing.assert_close(ring[L - 1, pos % n_ring], q_all[pos])


@pytest.mark.parametrize("line_chunks", ["last", "none"])
def test_prefill_lines_with_line_chunks_last_or_none_names_the_field(line_chunks):
    with pytest.raises(SparseConfigError, match="line_chunks"):
        LoopServeConfig.from_dict({"prefill": "lines", "line_chunks": line_chunks})
    with pytest.raises(SparseConfigError, match="line_chunks"):
        LoopServeConfig.from_dict({"line_chunks": "some"})


def test_line_chunks_auto_is_last_with_the_dense_prefill_and_all_with_the_sparse_one():
    assert LoopServeConfig().line_chunks == "auto" and LoopServeConfig().prefill == "dense"
    st_auto, v_auto, s_auto, _, planned, _ = _prefill("auto")
    _, v_last, s_last, _, _, _ = _prefill("last")
    assert [p[0] for p in planned] == [False, False, True]
    assert torch.equal(v_auto, v_last) and torch.equal(s_auto, s_last)
    shape = SimpleNamespace(num_layers=L, num_kv_heads=HK, num_qo_heads=HQ, head_dim=D)
    lines = LoopServeRunner(LoopServeConfig(prefill="lines"), shape, torch.device("cpu"), use_kernels=False)
    assert lines._chunk_selects(False) and lines._chunk_selects(True)
