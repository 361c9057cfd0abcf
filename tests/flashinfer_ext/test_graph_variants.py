"""Contract: under psa / loopserve / lastwindow a decode batch without a sparse row replays SGLang's stock decode
graph (recorded beside the sparse one, sglang_sparse.graph_variants) instead of decoding eagerly; sparse steady
steps keep the sparse graph; anything else stays eager. The CPU checks the host decisions and the planning of
both variants; the GPU server tests replay real graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_sparse import graph_variants
from sglang_sparse.api_hooks import graph_gate_hook
from sglang_sparse.loopserve.runner import STATE_ATTR
from sglang_sparse.loopserve.stats import COL_KIND, KIND_DENSE

from .test_loopserve_graph import _captured, plan_replay
from .test_loopserve_reselect import STEADY


@pytest.fixture
def stock_capture():
    """SGLang's capture label while it records its second (no-LoRA = stock) variant of a batch size."""
    from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

    _set_capture_lora_variant(graph_variants.DENSE)
    yield
    _set_capture_lora_variant(None)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_a_batch_without_sparse_rows_replays_the_stock_graph(lastwindow):
    c = _captured(lastwindow, STEADY[lastwindow])
    assert c.graphs.graph_variant(c.fb) == "sparse"  # steady sparse rows: the sparse graph
    for req in c.fb.sampling_info.sparse_reqs:  # prompts below min_context: no row is sparse
        delattr(req, STATE_ATTR)
    assert c.graphs.graph_variant(c.fb) == "dense"
    plan_replay(c)  # the stock graph's planning: no sparse lists, the step's dense statistics
    assert c.runner.dec is None and c.graphs.dense_replays == 1 and c.graphs.replays == 0
    # the step's rows: host tuples only (no tensor, no device copy), dense rows with the requests' alpha
    assert c.runner.step_rows is None and c.runner.bs == c.fb.batch_size
    assert len(c.runner.dense_rows) == c.fb.batch_size and all(r[COL_KIND] == KIND_DENSE for r in c.runner.dense_rows)
    # SGLang asks the variant again while loading the batch, after the planning: the same answer
    assert c.graphs.graph_variant(c.fb, peek=True) == "dense"
    assert c.graphs.graph_variant(SimpleNamespace(), peek=True) is None


def test_a_batch_with_a_selecting_sparse_row_stays_eager():
    from .test_loopserve_reselect import LOOPSERVE

    c = _captured(False, LOOPSERVE, all_topb=False)
    assert c.graphs.graph_variant(c.fb) is None


def test_the_stock_variant_captures_the_stock_decode(stock_capture):
    c = _captured(True, STEADY[True])  # both sizes captured while SGLang records its stock variant
    assert c.graphs._dicts == {} and c.runner.dec is None


def test_gate_and_variant_hooks_pick_the_recorded_graph():
    answers = {"steady": "sparse", "short": "dense", "selecting": None}
    backend = SimpleNamespace(sparse_graph_variant=lambda fb, peek=False: answers[fb], sparse_stock_graphs=True)
    dual = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, server_args=SimpleNamespace()))
    single = SimpleNamespace(model_runner=dual.model_runner)
    seen = []
    assert graph_variants.capture_hook(lambda r: seen.append(r), dual) is None and seen == [dual]
    assert dual.record_nolora_graph and graph_variants.dual_capture(dual) and not graph_variants.dual_capture(single)
    assert [graph_gate_hook(True, dual, fb) for fb in answers] == [True, True, False]
    assert [graph_gate_hook(True, single, fb) for fb in answers] == [True, False, False]  # no stock graph recorded
    assert graph_gate_hook(False, dual, "short") is False  # SGLang said no: no graph
    stock = lambda r, fb: "stock answer"  # noqa: E731
    assert [graph_variants.resolve_variant_hook(stock, dual, fb) for fb in answers] == ["lora", "nolora", "lora"]
    assert graph_variants.resolve_variant_hook(stock, single, "short") == "stock answer"
    # a server with LoRA adapters keeps SGLang's own pair
    lora = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend,
                                                        server_args=SimpleNamespace(enable_lora=True)))
    graph_variants.capture_hook(lambda r: None, lora)
    assert not graph_variants.dual_capture(lora)
    # and a mode configured without stock graphs ("stock_graphs": false) records its sparse graphs only
    off = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(
        sparse_graph_variant=backend.sparse_graph_variant, sparse_stock_graphs=False), server_args=SimpleNamespace()))
    graph_variants.capture_hook(lambda r: None, off)
    assert not graph_variants.dual_capture(off)


def test_psa_variant_follows_min_context_and_epsilon():
    from sglang_sparse.config import PsaConfig
    from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner

    cfg = PsaConfig.from_dict({"min_context": 100, "epsilon": 0.95})
    runner = PsaCpuRunner(cfg, 16, AttnShape(2, 4, 2, 8), torch.device("cpu"))

    def batch(lens, eps):
        reqs = [SimpleNamespace(sampling_params=SimpleNamespace(
            custom_params=None if e is None else {"sparse": {"epsilon": e}})) for e in eps]
        return SimpleNamespace(batch_size=len(lens), seq_lens_cpu=torch.tensor(lens),
                               sampling_info=SimpleNamespace(sparse_reqs=reqs))

    assert runner.graph_variant(batch([150, 40], [None, None])) == "sparse"
    short = batch([40, 99], [None, None])
    assert runner.graph_variant(short) == "dense" and runner.graph_variant(short, peek=True) == "dense"
    # a long row with epsilon 1.0 decodes densely and keeps no metadata (built at a row's first sparse step): stock graph
    assert runner.graph_variant(batch([150, 40], [1.0, None])) == "dense"
    runner.begin_dense_graph_batch(short, in_capture=False)
    assert not runner.sparse_batch and not runner.graph_mode and len(runner.dense_rows[0]) == 2


def test_select_variant_is_recorded_after_the_sparse_one_and_replayed_for_reselecting_steps():
    """loopserve (``sparse_select_graphs``): SGLang's per-shape capture of the sparse variant is followed by the
    re-selecting variant (the same forward, label ``SELECT``, set while it records) for batch sizes up to the
    backend's ``sparse_select_max_bs``; the gate and the variant hook send re-selecting steps to it."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_lora_variant

    answers = {"steady": "sparse", "short": "dense", "selecting": "select", "wide": None}
    backend = SimpleNamespace(sparse_graph_variant=lambda fb, peek=False: answers[fb], sparse_stock_graphs=True,
                              sparse_select_graphs=True, sparse_select_max_bs=8)
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, server_args=SimpleNamespace()))
    graph_variants.capture_hook(lambda r: None, runner)
    assert graph_variants.select_capture(runner)
    recorded = []

    def capture_one_shape(r, size, forward, stream_idx, label):
        recorded.append((size, label, get_capture_lora_variant()))

    for size in (16, 8):
        for label in (graph_variants.SPARSE, graph_variants.DENSE):
            from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

            _set_capture_lora_variant(label)
            graph_variants.capture_one_shape_hook(capture_one_shape, runner, size, "fwd", None, label)
    _set_capture_lora_variant(None)
    sp, de, se = graph_variants.SPARSE, graph_variants.DENSE, graph_variants.SELECT
    assert recorded == [(16, sp, sp), (16, de, de), (8, sp, sp), (8, se, se), (8, de, de)]
    assert [graph_gate_hook(True, runner, fb) for fb in answers] == [True, True, True, False]
    stock = lambda r, fb: "stock answer"  # noqa: E731
    assert [graph_variants.resolve_variant_hook(stock, runner, fb) for fb in answers] == [sp, de, se, sp]
    # without the backend's offer (psa, lastwindow, select_graph_rows 0): two variants, as before
    backend.sparse_select_graphs = False
    plain = SimpleNamespace(model_runner=runner.model_runner)
    graph_variants.capture_hook(lambda r: None, plain)
    assert not graph_variants.select_capture(plain)
    assert graph_gate_hook(True, plain, "selecting") is False
