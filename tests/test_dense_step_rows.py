"""Contract: a decode batch a sparse mode leaves to the stock decode costs host tuples only.

Below ``min_context`` (psa) or without a LoopServe row (loopserve, lastwindow) a decode step builds no tensor and
makes no device copy for its statistics: its rows are host tuples, shared between steps while they fold nothing
into the server counters; a request's options are read once. CPU, the real runners and mixins.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_sparse.config import LastWindowConfig, LoopServeConfig, PsaConfig
from sglang_sparse.loopserve.backend import LoopServeMixin
from sglang_sparse.loopserve.runner import STATE_ATTR, LoopServeRunner, request_options
from sglang_sparse.loopserve.stats import COL_ALPHA, COL_KIND, KIND_DENSE, LoopServeStats
from sglang_sparse.psa.backend import PsaDecodeMixin
from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner
from sglang_sparse.psa.stats import COL_EPS, COL_SPARSE, ROW_ADAPTIVE_DENSE, PsaStats
from sglang_sparse.psa.switch import _PROBE_ATTR
from sglang_sparse.stats import DenseRowCache, StepRows

SHAPE = AttnShape(2, 4, 2, 8)


def _req(i: int, sparse: dict | None = None):
    custom = None if sparse is None else {"sparse": sparse}
    return SimpleNamespace(rid=f"r{i}", sampling_params=SimpleNamespace(custom_params=custom), customized_info=None,
                           origin_input_ids=[0] * 64, output_ids=[])


def _decode(reqs, lens):
    mode = SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False, is_extend=lambda: False)
    return SimpleNamespace(batch_size=len(reqs), seq_lens_cpu=torch.tensor(lens), forward_mode=mode,
                           sampling_info=SimpleNamespace(sparse_reqs=list(reqs)))


def _psa_backend(cfg: PsaConfig):
    backend = type("PsaBackend", (), dict(vars(PsaDecodeMixin)))()
    backend._psa_runner = PsaCpuRunner(cfg, 16, SHAPE, torch.device("cpu"))
    backend.sparse_stats, backend._psa_metrics, backend._psa_dense_rows = PsaStats(), None, DenseRowCache()
    return backend


def test_step_rows_take_a_host_tensor_or_final_tuples_and_the_cache_shares_and_stays_bounded():
    rows = ((0.0, 1.0), (0.0, 2.0))
    seen = []
    r = StepRows(None, seen.append, rows=rows)
    assert len(r) == 2 and r[1] == (0.0, 2.0) and seen == [list(rows)]  # counted once, at construction
    with pytest.raises(ValueError, match="exactly one of host"):
        StepRows(torch.zeros(2, 2), rows=rows)
    with pytest.raises(ValueError, match="exactly one of host"):
        StepRows(None)
    cache = DenseRowCache(max_entries=2)
    a = cache.rows(rows)
    assert cache.rows(((0.0, 1.0), (0.0, 2.0))) is a  # equal rows: the same object, built once
    cache.rows(((0.0, 3.0),))
    cache.rows(((0.0, 4.0),))  # a third batch drops the oldest
    assert len(cache) == 2 and cache.rows(rows) is not a
    with pytest.raises(ValueError, match="max_entries"):
        DenseRowCache(0)


def test_psa_short_decode_batch_is_host_tuples_shared_between_steps():
    backend = _psa_backend(PsaConfig.from_dict({"min_context": 100}))
    runner = backend._psa_runner
    reqs = [_req(0), _req(1, {"epsilon": 0.9})]
    runner.begin_batch(backend, _decode(reqs, [40, 60]))
    assert not runner.sparse_batch and runner.step_rows is None
    first = backend.psa_step_rows()
    assert [r[COL_EPS] for r in first] == [PsaConfig().epsilon, 0.9] and all(r[COL_SPARSE] == 0 for r in first)
    runner.begin_batch(backend, _decode(reqs, [41, 61]))  # the next step of the same requests: the same rows
    assert backend.psa_step_rows() is first
    # a stock-graph replay of the same batch (gate, then the padded view's plan): the same shared rows
    assert runner.graph_variant(_decode(reqs, [42, 62])) == "dense"
    view = SimpleNamespace(batch_size=2, seq_lens_cpu=torch.tensor([42, 62]), sampling_info=None,
                           forward_mode=SimpleNamespace(is_decode=lambda: True))
    runner.begin_dense_graph_batch(view, in_capture=False)
    assert backend.psa_step_rows() is first


def test_psa_switched_rows_are_fresh_host_rows_counted_every_step():
    backend = _psa_backend(PsaConfig.from_dict({"min_context": 100}))
    runner = backend._psa_runner
    req = _req(0)
    setattr(req, _PROBE_ATTR, True)  # the adaptive switch sent it dense
    for step in (1, 2):
        runner.begin_batch(backend, _decode([req], [150 + step]))
        rows = backend.psa_step_rows()
        assert runner.step_rows is None and rows[0][COL_SPARSE] == ROW_ADAPTIVE_DENSE
        assert backend.sparse_stats.switched_dense_rows == step  # a fresh StepRows per step: counted each time


@pytest.mark.parametrize("cfg", [LoopServeConfig(), LastWindowConfig()], ids=["loopserve", "lastwindow"])
def test_loopserve_decode_batch_without_sparse_rows_is_host_tuples(cfg):
    backend = type("LsBackend", (), dict(vars(LoopServeMixin)))()
    runner = backend._ls_runner = LoopServeRunner(cfg, SHAPE, torch.device("cpu"), use_kernels=False)
    backend.sparse_stats, backend._ls_metrics, backend._ls_dense_rows = LoopServeStats(), None, DenseRowCache()
    reqs = [_req(0), _req(1, {"alpha": 0.5} if cfg.mode == "loopserve" else None)]
    runner.begin_batch(backend, _decode(reqs, [40, 60]))
    assert runner.dec is None and runner.step_rows is None
    first = backend.loopserve_step_rows()
    alphas = [request_options(cfg, r)[0] for r in reqs]
    assert [r[COL_ALPHA] for r in first] == alphas and all(r[COL_KIND] == KIND_DENSE for r in first)
    runner.begin_batch(backend, _decode(reqs, [41, 61]))
    assert backend.loopserve_step_rows() is first and runner.dense_rows is None
    assert all(getattr(r, STATE_ATTR, None) is None for r in reqs)


def test_loopserve_request_options_are_read_once_per_request():
    cfg = LoopServeConfig()
    req = _req(0, {"alpha": 0.5, "budget": 256})
    assert request_options(cfg, req) == (0.5, 256)
    req.sampling_params.custom_params = {"sparse": {"alpha": 0.7}}  # a Req's options never change: not re-read
    assert request_options(cfg, req) == (0.5, 256)
    assert request_options(cfg, None) == (cfg.alpha, cfg.budget)
