"""Contract: the psa mode maps its user-facing knobs onto the kernel config one to one; per-request
options are validated and clamped to the server's limits; step rows summarise into the per-request
report and the server counters (the installer itself is exercised through the real server in
tests/test_psa_server.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.runner import kernel_config
from sglang_sparse.psa.stats import STEP_COLS, PsaStats, account_rows, summarize_steps
from sglang_sparse.stats import StepRows
from sglang_sparse.request_params import RequestParamsError, normalize_request_options, request_epsilon


def test_kernel_config_maps_user_knobs():
    k = kernel_config(PsaConfig.from_dict({"epsilon": 0.9, "micro_batch_blocks": 4, "sink_pages": 2,
                                           "local_pages": 3, "max_blocks": 77}))
    assert (k.epsilon, k.micro_batch_blocks, k.sink_blocks, k.local_blocks, k.max_blocks) == (0.9, 4, 2, 3, 77)


def test_request_epsilon_is_validated_and_clamped_to_the_server_floor():
    cfg = PsaConfig.from_dict({"epsilon": 0.95, "min_request_epsilon": 0.8})
    assert normalize_request_options("psa", cfg, {"sparse": {"epsilon": 0.9}}) == {"epsilon": 0.9}
    assert normalize_request_options("psa", cfg, {"sparse": {"epsilon": 0.3}}) == {"epsilon": 0.8}
    assert normalize_request_options("psa", cfg, {"sparse": {"epsilon": 1}}) == {"epsilon": 1.0}
    assert normalize_request_options("psa", cfg, {"other": 1}) is None
    assert normalize_request_options("psa", cfg, None) is None
    assert request_epsilon(cfg, {"sparse": {"epsilon": 0.85}}) == 0.85
    assert request_epsilon(cfg, None) == 0.95


@pytest.mark.parametrize("params, needle", [
    ({"sparse": {"epsilon": 0}}, "custom_params.sparse.epsilon = 0 is out of range"),
    ({"sparse": {"epsilon": 1.5}}, "expected a number in (0, 1]"),
    ({"sparse": {"epsilon": "high"}}, "custom_params.sparse.epsilon = 'high'"),
    ({"sparse": {"epsilon": True}}, "custom_params.sparse.epsilon = True"),
    ({"sparse": {"epsilon": float("nan")}}, "custom_params.sparse.epsilon = nan"),
    ({"sparse": {"alpha": 0.9}}, "unknown key(s) 'alpha' for mode 'psa'; allowed: epsilon"),
    ({"sparse": 0.9}, "custom_params.sparse must be an object"),
])
def test_bad_request_options_name_the_field_and_range(params, needle):
    with pytest.raises(RequestParamsError) as e:
        normalize_request_options("psa", PsaConfig(), params)
    assert needle in str(e.value)


def test_dense_server_refuses_request_options():
    from sglang_sparse.config import OffConfig

    with pytest.raises(RequestParamsError, match="runs --sparse off, which takes no per-request options"):
        normalize_request_options("off", OffConfig(), {"sparse": {"epsilon": 0.9}})


def _row(sparse, read, total, kept, units, eps):
    r = [0.0] * STEP_COLS
    r[0], r[1], r[2], r[3], r[4], r[5] = sparse, read, total, kept, units, eps
    return r


def test_step_rows_fold_into_counters_once_and_summarise_per_request():
    host = torch.tensor([_row(1, 30, 120, 5.7, 6, 0.9), _row(0, 0, 0, 0, 0, 0.95)])
    stats, seen = PsaStats(), []
    rows = StepRows(host, lambda r: (seen.append(len(r)), account_rows(r, stats, None)))
    assert rows[0] == (1.0, 30.0, 120.0, pytest.approx(5.7), 6.0, pytest.approx(0.9)) and rows[1][0] == 0
    assert seen == [2] and len(rows) == 2  # materialised once
    assert (stats.sparse_rows, stats.blocks_read, stats.blocks_total) == (1, 30, 120)
    s = summarize_steps([rows[1], rows[0], list(rows[0])])
    assert s["steps"] == 3 and s["sparse_decode_steps"] == 2
    assert s["blocks_read"] == 60 and s["blocks_total"] == 240 and s["read_fraction"] == 0.25
    assert s["kept_mass"] == pytest.approx(5.7 / 6) and s["epsilon"] == pytest.approx(0.9)
    assert summarize_steps([]) is None and summarize_steps(None) is None


def test_metrics_counters_register_under_the_sglang_sparse_prefix():
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_sparse.psa.stats import PsaMetrics

    reg = CollectorRegistry()
    m = PsaMetrics(reg)
    account_rows([_row(1, 5, 10, 0.97, 1, 0.95)], PsaStats(), m)
    text = generate_latest(reg).decode()
    assert "sglang_sparse:psa_blocks_read_total 5.0" in text
    assert 'sglang_sparse:psa_kept_mass_bucket{le="0.97"} 1.0' in text
    assert 'sglang_sparse:psa_read_fraction_bucket{le="0.5"} 1.0' in text


def test_graph_replay_view_gets_the_batch_per_request_epsilons():
    """SGLang's decode-graph replay view carries no sampling_info: the epsilons seen by the graph gate
    (the real batch) are kept and matched to the padded view by its lengths."""
    from types import SimpleNamespace

    from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner

    cfg = PsaConfig.from_dict({"min_context": 100, "epsilon": 0.95})
    runner = PsaCpuRunner(cfg, 16, AttnShape(2, 4, 2, 8), torch.device("cpu"))
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(custom_params=c)) for c in ({"sparse": {"epsilon": 0.7}}, None)]
    real = SimpleNamespace(batch_size=2, seq_lens_cpu=torch.tensor([150, 40]),
                           sampling_info=SimpleNamespace(sparse_reqs=reqs))
    assert runner.wants_graph(real)
    view = SimpleNamespace(batch_size=4, seq_lens_cpu=torch.tensor([150, 40, 1, 1]))
    eps, off, probe, got = runner._stashed_state(view, 4)
    assert eps == pytest.approx([0.7, 0.95, 1.0, 1.0]) and not any(off)
    # the undecided long request probes (the default switch); the short row (below min_context) and padding do not
    assert probe == [True, False, False, False]
    assert got[:2] == reqs and got[2:] == [None, None]
    other = SimpleNamespace(batch_size=4, seq_lens_cpu=torch.tensor([151, 41, 1, 1]))
    assert runner._stashed_state(other, 4) is None  # a different batch: no stale epsilons
    short = SimpleNamespace(batch_size=1, seq_lens_cpu=torch.tensor([40]), sampling_info=None)
    assert not runner.wants_graph(short)


def _req(rows=None, eps=None):
    from types import SimpleNamespace

    custom = {"sparse": {"epsilon": eps}} if eps is not None else None
    info = {"sparse_psa_steps": list(rows)} if rows is not None else None
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom), customized_info=info)


def test_adaptive_switch_sends_a_request_dense_after_its_probe_steps_read_too_much():
    """``dense_above`` / ``probe_steps``: the first probe_steps sparse rows of a request decide, once, whether it
    keeps decoding through PSA; prefill and dense rows do not count; the decision does not change afterwards."""
    from sglang_sparse.psa.switch import adaptive_dense

    cfg = PsaConfig.from_dict({"min_context": 100, "dense_above": 0.5, "probe_steps": 2})
    diffuse = _req([_row(0, 0, 0, 0, 0, 0.95), _row(1, 9, 10, 1.9, 2, 0.95)])
    assert not adaptive_dense(cfg, diffuse)  # one sparse row seen: still probing
    diffuse.customized_info["sparse_psa_steps"].append(_row(1, 8, 10, 1.9, 2, 0.95))
    assert adaptive_dense(cfg, diffuse)  # 17 / 20 blocks read > 0.5
    diffuse.customized_info["sparse_psa_steps"].append(_row(1, 1, 10, 1.9, 2, 0.95))
    assert adaptive_dense(cfg, diffuse)  # decided for good
    focused = _req([_row(1, 3, 10, 1.9, 2, 0.95), _row(1, 4, 10, 1.9, 2, 0.95), _row(1, 10, 10, 2, 2, 0.95)])
    assert not adaptive_dense(cfg, focused)  # 7 / 20 over the probe; later rows do not reopen it
    focused.customized_info["sparse_psa_steps"].append(_row(1, 10, 10, 2, 2, 0.95))
    assert not adaptive_dense(cfg, focused)
    probed = _req([_row(3, 9, 10, 2, 2, 0.95), _row(3, 9, 10, 2, 2, 0.95)])  # probe steps (exact result) count
    assert adaptive_dense(cfg, probed)
    never = PsaConfig.from_dict({"min_context": 100, "dense_above": 1.0, "probe_steps": 1})
    assert not adaptive_dense(never, _req([_row(1, 10, 10, 2, 2, 0.95)]))
    assert not adaptive_dense(cfg, None) and not adaptive_dense(cfg, _req())


def test_a_batch_of_switched_rows_replays_the_stock_graph_and_reports_them():
    """Rows the switch sent dense are not sparse: no metadata, the stock decode graph, sparse column 2."""
    from types import SimpleNamespace

    from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner
    from sglang_sparse.psa.stats import COL_SPARSE, ROW_ADAPTIVE_DENSE, ROW_PROBE

    cfg = PsaConfig.from_dict({"min_context": 100, "dense_above": 0.5, "probe_steps": 1})
    runner = PsaCpuRunner(cfg, 16, AttnShape(2, 4, 2, 8), torch.device("cpu"))
    switched, fresh = _req([_row(1, 9, 10, 1.9, 2, 0.95)]), _req()

    def batch(*reqs):
        return SimpleNamespace(batch_size=len(reqs), seq_lens_cpu=torch.tensor([150] * len(reqs)),
                               sampling_info=SimpleNamespace(sparse_reqs=list(reqs)),
                               forward_mode=SimpleNamespace(is_decode=lambda: True))

    assert runner.graph_variant(batch(switched)) == "dense"
    assert runner.graph_variant(batch(switched, fresh)) == "sparse"
    runner.begin_batch(None, batch(switched, fresh))
    assert runner._sparse_host.tolist() == [False, True] and runner._probe_host.tolist() == [False, True]
    assert runner.step_rows[:, COL_SPARSE].tolist() == [ROW_ADAPTIVE_DENSE, ROW_PROBE]  # undecided: a probe step
    runner.begin_batch(None, batch(switched))  # the stock decode: host rows only, counted (not shared)
    assert not runner.sparse_batch and runner.step_rows is None
    rows, plain = runner.dense_rows
    assert rows[0][COL_SPARSE] == ROW_ADAPTIVE_DENSE and not plain


def test_switched_rows_are_counted_and_reported_per_request():
    from sglang_sparse.psa.stats import PsaStats, account_rows, summarize_steps

    rows = [_row(0, 0, 0, 0, 0, 0.95), _row(3, 8, 10, 2, 2, 0.95), _row(1, 9, 10, 1.9, 2, 0.95),
            _row(2, 0, 0, 0, 0, 0.95), _row(2, 0, 0, 0, 0, 0.95)]
    stats = PsaStats()
    account_rows(rows, stats, None)
    assert stats.sparse_rows == 1 and stats.switched_dense_rows == 2 and stats.blocks_read == 9
    assert stats.probe_rows == 1 and stats.probe_blocks_read == 8 and stats.to_dict()["probe_read_fraction"] == 0.8
    rep = summarize_steps(rows)
    assert rep["sparse_decode_steps"] == 1 and rep["switched_dense_steps"] == 2 and rep["read_fraction"] == 0.9
    assert rep["probe_steps"] == 1 and rep["probe_read_fraction"] == 0.8  # probe rows: not in read_fraction


def test_api_hooks_summarise_whichever_mode_left_step_rows():
    from sglang_sparse.loopserve import stats as loopserve_stats
    from sglang_sparse.api_hooks import STEP_SOURCES, request_summary

    assert {key for _, key, _ in STEP_SOURCES} == {"sparse_psa_steps", loopserve_stats.STEP_KEY}
    psa = request_summary({"sparse_psa_steps": [_row(0, 0, 0, 0, 0, 0.9), _row(1, 4, 10, 1.8, 2, 0.9)]})
    assert psa["mode"] == "psa" and psa["blocks_read"] == 4 and psa["read_fraction"] == 0.4
    assert request_summary({"weight_version": "default"}) is None and request_summary(None) is None


def test_psa_backend_gate_is_the_one_the_graph_hook_asks():
    """``api_hooks.graph_gate_hook`` asks the backend's ``sparse_wants_graph`` (one name for every mode): the psa
    backend's gate defers to its runner's ``wants_graph`` (which decides on the real batch)."""
    from types import SimpleNamespace

    from sglang_sparse.api_hooks import graph_gate_hook
    from sglang_sparse.psa.backend import PsaDecodeMixin

    backend = type("PsaBackend", (), dict(vars(PsaDecodeMixin)))()
    backend._psa_runner = SimpleNamespace(wants_graph=lambda fb: fb == "sparse batch")
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    assert graph_gate_hook(True, runner, "sparse batch") is True
    assert graph_gate_hook(True, runner, "dense batch") is False
    assert graph_gate_hook(False, runner, "sparse batch") is False


def test_block_metadata_is_built_at_a_requests_first_sparse_decode_step_and_after_a_retraction():
    """Extends leave metadata alone (stock prefill, prefill CUDA graphs); a sparse row's first decode step rebuilds
    [0, len - 1) for every layer (a cached prefix written by a dense-decoding request has none), later steps only fold
    their own token; a retraction (new pages) or a row whose request is unknown rebuilds again."""
    from types import SimpleNamespace

    from sglang_sparse.psa.cuda_runner import PsaCudaRunner
    from sglang_sparse.psa.runner import AttnShape

    cfg = PsaConfig.from_dict({"min_context": 64, "block_size": 16, "dense_above": 1.0})
    k = torch.zeros(512, 2, 8, dtype=torch.bfloat16)
    pool = SimpleNamespace(get_key_buffer=lambda lid: k)
    rtt = torch.arange(2 * 256, dtype=torch.int32).view(2, 256)
    runner = PsaCudaRunner(cfg, 16, AttnShape(2, 4, 2, 8), torch.device("cpu"), token_to_kv_pool=pool,
                           req_to_token=rtt, max_batch_size=2, sm_scale=0.35, out_dtype=torch.bfloat16)
    calls = []
    runner.meta.update = lambda lid, k_buf, rtt_, rpi, table, start, end, n_new: calls.append((lid, end.tolist()))
    long_req, short_req = _req(), _req()
    long_req.retraction_count = short_req.retraction_count = 0

    def plan(lens, reqs, decode=True):
        mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: decode)
        fb = SimpleNamespace(forward_mode=mode, batch_size=len(lens), seq_lens_cpu=torch.tensor(lens),
                             seq_lens=torch.tensor(lens), req_pool_indices=torch.arange(len(lens)),
                             extend_prefix_lens_cpu=[0] * len(lens), extend_seq_lens_cpu=lens,
                             sampling_info=SimpleNamespace(sparse_reqs=reqs))
        runner._plan_rows(fb, decode)
        if runner.sparse_batch:
            runner._plan_decode_meta(None, fb, runner._block_table(fb.req_pool_indices, max(lens)))
        return runner

    plan([200, 40], [long_req, short_req], decode=False)  # an extend: nothing
    assert calls == []
    plan([201, 41], [long_req, short_req])  # first sparse step of row 0: rebuild [0, 200), both layers
    assert calls == [(0, [200, 0]), (1, [200, 0])] and runner.sparse_batch
    calls.clear()
    plan([202, 42], [long_req, short_req])  # covered: only the in-forward fold
    assert calls == [] and runner.meta_rebuilds == 1
    long_req.retraction_count = 1  # re-prefilled into new pages
    plan([203, 43], [long_req, short_req])
    assert calls == [(0, [202, 0]), (1, [202, 0])]
    calls.clear()
    plan([204, 44], [None, short_req])  # a row without its request: cannot vouch for it
    assert calls == [(0, [203, 0]), (1, [203, 0])]


def test_page_one_metadata_rows_follow_the_request_slot_and_a_reclaimed_request_is_rebuilt():
    """Page size 1: a sparse row's slot holds metadata rows for its whole context (the batch's block table names
    them); a row the free list cannot serve attends its whole context that step (never another request's rows);
    rows of requests outside the live batches are reclaimed for it, and a request whose rows were reclaimed is
    rebuilt from position 0 when it comes back, although its own record says it was covered."""
    from types import SimpleNamespace

    from flashinfer_ext.psa.meta_rows import TRASH_ROW
    from sglang_sparse.psa.cuda_runner import PsaCudaRunner
    from sglang_sparse.psa.runner import AttnShape

    cfg = PsaConfig.from_dict({"min_context": 64, "block_size": 16, "dense_above": 1.0})
    k = torch.zeros(512, 2, 8, dtype=torch.bfloat16)
    pool = SimpleNamespace(get_key_buffer=lambda lid: k)
    rtt = torch.zeros(3, 256, dtype=torch.int32)
    runner = PsaCudaRunner(cfg, 16, AttnShape(2, 4, 2, 8), torch.device("cpu"), token_to_kv_pool=pool,
                           req_to_token=rtt, max_batch_size=3, sm_scale=0.35, out_dtype=torch.bfloat16, page_size=1)
    assert runner.rows.num_rows == 512 // 16 + 1 + 3 and not runner.page_is_block  # 35 rows to hand out
    calls = []
    runner.meta.update = lambda lid, k_buf, rtt_, rpi, table, start, end, n_new: calls.append((lid, end.tolist()))

    def req(slot, rid):
        r = _req()
        r.req_pool_idx, r.rid, r.retraction_count = slot, rid, 0
        return r

    def plan(lens, reqs):
        mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
        fb = SimpleNamespace(forward_mode=mode, batch_size=len(lens), seq_lens_cpu=torch.tensor(lens),
                             seq_lens=torch.tensor(lens), req_pool_indices=torch.tensor([r.req_pool_idx if r else 2 for r in reqs]),
                             sampling_info=SimpleNamespace(sparse_reqs=reqs))
        calls.clear()
        runner._plan_rows(fb, True)
        if runner.sparse_batch:
            runner._plan_decode_meta(None, fb, runner._block_table(fb.req_pool_indices, max(lens)))
        return runner._rows_host[2]  # which rows decode sparsely

    a, b, c = req(0, "a"), req(1, "b"), req(2, "c")
    assert plan([201], [a]) == [True] and calls == [(0, [200]), (1, [200])]
    rows_a = runner.rows.rows_of(0)
    assert len(rows_a) == 13 and runner._table_buf[0, :13].tolist() == rows_a and TRASH_ROW not in rows_a
    assert plan([202], [a]) == [True] and calls == []  # covered: only the in-forward fold
    # b takes 13 rows; c's 13 do not fit (9 free) and a, in the last decode batch, is kept: c attends everything
    assert plan([201, 201], [b, c]) == [True, False] and runner.meta_row_shortfalls == 1
    assert calls == [(0, [200, 0]), (1, [200, 0])] and runner.rows.rows_of(2) == []
    assert plan([202, 202], [b, c]) == [True, True]  # a is outside both live batches now: its rows go to c
    assert runner.rows.rows_of(0) == [] and calls == [(0, [0, 201]), (1, [0, 201])]
    assert not set(runner.rows.rows_of(1)) & set(runner.rows.rows_of(2))
    assert plan([203], [a]) == [False]  # a is back: b and c were live in the last batch, nothing to reclaim yet
    assert plan([203], [a]) == [True]   # now they are not: a gets rows, fresh, rebuilt from position 0
    assert calls == [(0, [202]), (1, [202])]
    assert plan([204], [None]) == [False]  # a row without its request has no slot: it attends everything
    report = PsaStats(reporter=runner.meta_report).to_dict()  # /server_info's stats carry the runner's counters
    assert report["meta_rows_total"] == 36 and report["meta_rows_used"] == runner.rows.used_rows > 0
    assert report["meta_row_shortfalls"] == runner.meta_row_shortfalls >= 2 and report["meta_rebuilds"] >= 3
    assert "reporter" not in report
