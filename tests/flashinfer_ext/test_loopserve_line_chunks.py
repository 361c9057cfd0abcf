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

from .kv_pool import layered_backend, make_pool

L, HQ, HK, D = 2, 4, 2, 64
PROMPT, CHUNK = 300, 100
SINK, LOCAL = 4, 16


def _extend_batch(prefix: int, ext: int, req, pool):
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False, is_extend=lambda: True)
    return SimpleNamespace(forward_mode=mode, batch_size=1, seq_lens_cpu=torch.tensor([prefix + ext]),
                           extend_seq_lens_cpu=[ext], extend_prefix_lens_cpu=[prefix],
                           req_pool_indices_cpu=pool.req_pool_indices.cpu(),
                           sampling_info=SimpleNamespace(sparse_reqs=[req]))


def _prefill(line_chunks: str, seed: int = 0, prefill: str = "dense", use_kernels: bool = False):
    """Run a ``PROMPT``-token prompt through the runner in chunks of ``CHUNK`` (each layer its own keys and queries);
    the request state after it."""
    pool = make_pool([PROMPT], HQ, HK, D, torch.float32, 1, seed=seed)
    backend, g = layered_backend(pool, L, seed + 7)
    cfg = LoopServeConfig(min_context=64, alpha=0.9, sink_tokens=SINK, local_window=LOCAL, sampled_rows=16,
                          line_chunks=line_chunks, prefill=prefill)
    shape = SimpleNamespace(num_layers=L, num_kv_heads=HK, num_qo_heads=HQ, head_dim=D)
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=use_kernels)
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), origin_input_ids=[0] * PROMPT,
                          req_pool_idx=int(pool.req_pool_indices[0]))
    q_all = torch.randn(L, PROMPT, HQ, D, generator=g)
    planned = []
    for prefix in range(0, PROMPT, CHUNK):
        runner.begin_batch(backend, _extend_batch(prefix, CHUNK, req, pool))
        assert len(runner.ext_rows) == 1
        r = runner.ext_rows[0]
        planned.append((r.sel_plan is not None, int(r.sample.numel()), r.last_chunk))
        for lid in range(L):
            q3 = q_all[lid, prefix: prefix + CHUNK]
            o3 = torch.zeros_like(q3)
            runner.extend(backend, o3, q3, SimpleNamespace(layer_id=lid, scaling=D ** -0.5))
            if prefill == "dense":  # the stock attention's rows are left as they are
                assert torch.count_nonzero(o3) == 0
        runner.finish_extend(backend)
    st = getattr(req, STATE_ATTR)
    assert st.prefill_done
    vmask, smask = st.vmask[:, :, :PROMPT].clone(), st.smask[:, :, :PROMPT].clone()
    ring = st.ring.clone()
    st.finalize()
    k_bufs = [backend.token_to_kv_pool.get_key_buffer(lid) for lid in range(L)]
    return st, vmask, smask, ring, planned, (q_all, k_bufs, pool, cfg)


def _expected_last_chunk_masks(env, use_kernels=False):
    """Each layer's lines selected alone (estimation + vs_select, the reference or the kernels) from the last chunk's
    sampled rows."""
    from flashinfer_ext.loopserve.reference import vs_estimate_reference
    from flashinfer_ext.loopserve.vs_estimate import VSLineSums, sample_query_rows, vs_estimate
    from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select, vs_select_plan

    q_all, k_bufs, pool, cfg = env
    prefix = PROMPT - CHUNK
    sample = sample_query_rows(CHUNK, cfg.sampled_rows)
    slots = pool.req_to_token[pool.req_pool_indices[0]]
    plan = vs_select_plan(PROMPT, prefix, VSSelectConfig(alpha=cfg.alpha, sink_tokens=SINK, local_window=LOCAL), "cpu",
                          use_kernel=use_kernels)
    v = torch.zeros(L, HK, PROMPT, dtype=torch.bool)
    s = torch.zeros_like(v)
    for lid in range(L):
        q_rows = q_all[lid, prefix + sample]
        if use_kernels:
            sums = vs_estimate(q_rows.contiguous(), sample + prefix, k_bufs[lid], slots, PROMPT, sm_scale=D ** -0.5)
        else:
            sums = VSLineSums(*vs_estimate_reference(q_rows, sample + prefix, k_bufs[lid], slots, PROMPT, D ** -0.5),
                              HQ // HK, q_rows.shape[0])
        sel = vs_select(sums, plan=plan)
        for h in range(HK):
            v[lid, h, sel.v_idx[h, : sel.v_cnt[h]].long()] = True
            s[lid, h, sel.s_idx[h, : sel.s_cnt[h]].long()] = True
    return v, s


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
    _, _, _, ring, _, env = _prefill(line_chunks)
    q_all = env[0]
    n_ring = ring.shape[1]  # n_d
    pos = torch.arange(PROMPT - n_ring, PROMPT)
    for lid in range(L):
        torch.testing.assert_close(ring[lid, pos % n_ring], q_all[lid, pos])


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "kernel"])
def test_deferred_selection_gives_each_layer_the_lines_it_gets_selected_alone(use_kernels):
    """prefill dense: the lines are selected after the forward for all layers at once; each layer's lines equal those
    of its own estimation and selection (reference path; Triton kernels, under the interpreter on a CPU)."""
    _, v_last, s_last, _, _, env = _prefill("last", use_kernels=use_kernels)
    v_exp, s_exp = _expected_last_chunk_masks(env, use_kernels)
    assert not (torch.equal(v_exp[0], v_exp[1]) and torch.equal(s_exp[0], s_exp[1]))  # layers differ: a mix-up shows
    assert torch.equal(v_last, v_exp) and torch.equal(s_last, s_exp)


def test_layer_groups_of_the_deferred_selection_do_not_change_the_lines(monkeypatch):
    from sglang_sparse.loopserve import prefill_lines

    st_one, v_one, s_one, _, _, _ = _prefill("all")
    monkeypatch.setattr(prefill_lines, "SELECT_BATCH_ENTRIES", 1)  # one layer per stacked selection
    st_grp, v_grp, s_grp, _, _, _ = _prefill("all")
    assert torch.equal(v_one, v_grp) and torch.equal(s_one, s_grp)
    torch.testing.assert_close(st_one.acc, st_grp.acc)


def test_sparse_prefill_selects_per_layer_and_the_dense_one_after_the_forward_alike():
    """prefill lines selects inside each layer (its attention needs them); the dense prefill's deferred selection
    yields the same lines from the same chunks."""
    _, v_dense, s_dense, _, _, _ = _prefill("all")
    _, v_lines, s_lines, _, _, _ = _prefill("all", prefill="lines")
    assert torch.equal(v_dense, v_lines) and torch.equal(s_dense, s_lines)


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


@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_stacked_layers_select_as_each_layer_alone(use_kernel):
    """flashinfer_ext: vs_select over stack_line_sums of several layers (the split search as a Triton launch over
    layers x KV heads rows, or its torch reference) returns each layer's own selection."""
    from flashinfer_ext.loopserve.reference import vs_estimate_reference
    from flashinfer_ext.loopserve.vs_estimate import VSLineSums, sample_query_rows, stack_line_sums
    from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select, vs_select_plan

    n_layers, seq, prefix = 5, 257, 129
    pool = make_pool([seq], HQ, HK, D, torch.float32, 1, seed=3, planted=True)
    g = torch.Generator().manual_seed(11)
    slots = pool.req_to_token[pool.req_pool_indices[0]]
    sample = sample_query_rows(seq - prefix, 24) + prefix
    parts = []
    for _ in range(n_layers):
        k = torch.randn(pool.k_buffer.shape, generator=g)
        q = torch.randn(sample.numel(), HQ, D, generator=g)
        parts.append(VSLineSums(*vs_estimate_reference(q, sample, k, slots, seq, D ** -0.5), HQ // HK, q.shape[0]))
    plan = vs_select_plan(seq, prefix, VSSelectConfig(alpha=0.9, sink_tokens=SINK, local_window=LOCAL), "cpu",
                          use_kernel=use_kernel)
    both = vs_select(stack_line_sums(parts), plan=plan)
    for lid, part in enumerate(parts):
        one = vs_select(part, plan=plan)
        rows = slice(lid * HK, (lid + 1) * HK)
        for got, want in ((both.v_idx, one.v_idx), (both.v_cnt, one.v_cnt), (both.s_idx, one.s_idx),
                          (both.s_cnt, one.s_cnt), (both.covered_lb, one.covered_lb)):
            assert torch.equal(got[rows], want)
    with pytest.raises(ValueError, match="group_size or num_rows"):
        stack_line_sums([parts[0], VSLineSums(*[t[:, :] for t in (parts[1].v_sum, parts[1].v_max, parts[1].s_sum,
                                                                   parts[1].s_max)], HQ // HK, 7)])
