"""Contract: a LoopServe / lastwindow steady decode step planned for a CUDA-graph replay (sglang_sparse.loopserve.graph)
decodes exactly like the eager step: same outputs for the real rows, zeros for the padding rows, same statistics,
the same queries committed to the rings; only steady steps that fit the captured buffers are replayed.

On the CPU the captured decode is run as Python over the static buffers it would record (Triton interpreter);
the GPU server test (tests/test_gpu_loopserve_server.py) replays real graphs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_sparse.loopserve.graph import LoopServeGraphs
from sglang_sparse.loopserve.runner import STATE_ATTR, LoopServeRunner

from .test_loopserve_reselect import D, HQ, LOOPSERVE, STEADY, L, _Mode, _setup

MAX_BS = 4


def _decode_layers(runner, backend, q3):
    o3 = torch.zeros(q3.shape[0], HQ, D)
    for lid in range(L):
        runner.decode(backend, o3, q3, SimpleNamespace(layer_id=lid, scaling=D ** -0.5))
    return o3


def _captured(lastwindow, case, width=256, all_topb=True, bs_cap=16):
    """A runner with its graphs captured at batch sizes 4 and 2 (largest first, as SGLang does) over a static
    request-index buffer, and the batch of ``case`` (3 rows) ready to be replayed at padded size 4."""
    cfg, shape, backend, fb, reqs, q3, pool = _setup(lastwindow, *case, all_topb=all_topb)
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True)
    graphs = LoopServeGraphs(runner, width, max_bs=bs_cap)
    rpi_buf = torch.zeros(MAX_BS, dtype=torch.int64)
    for bs in (MAX_BS, 2):
        view = SimpleNamespace(batch_size=bs, forward_mode=_Mode(), req_pool_indices=rpi_buf[:bs],
                               seq_lens_cpu=torch.ones(bs, dtype=torch.int64))
        graphs.plan(backend, view, in_capture=True)
        if runner.dec is not None:  # the capture's forward over the sparse path (else the backend records stock)
            _decode_layers(runner, backend, torch.zeros(bs, HQ, D))
    return SimpleNamespace(runner=runner, graphs=graphs, backend=backend, fb=fb, reqs=reqs, q3=q3, rpi_buf=rpi_buf)


def plan_replay(c):
    """SGLang's load_batch: the static buffers filled (padding rows: index 0, length 1), then the view planned."""
    raw = c.fb.batch_size
    c.rpi_buf.zero_()
    c.rpi_buf[:raw] = c.fb.req_pool_indices
    lens = torch.ones(MAX_BS, dtype=torch.int64)
    lens[:raw] = c.fb.seq_lens_cpu
    view = SimpleNamespace(batch_size=MAX_BS, forward_mode=_Mode(), req_pool_indices=c.rpi_buf, seq_lens_cpu=lens)
    c.graphs.plan(c.backend, view, in_capture=False)


def _replay(c):
    """:func:`plan_replay`, then the captured decode over the padded batch."""
    plan_replay(c)
    raw = c.fb.batch_size
    q_pad = torch.zeros(MAX_BS, HQ, D)
    q_pad[:raw] = c.q3
    return _decode_layers(c.runner, c.backend, q_pad)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_replayed_steady_step_decodes_like_the_eager_step(lastwindow):
    eager_cfg, shape, backend, fb, reqs, q3, _ = _setup(lastwindow, *STEADY[lastwindow], all_topb=True)
    eager = LoopServeRunner(eager_cfg, shape, torch.device("cpu"), use_kernels=True)
    eager.begin_batch(backend, fb)
    o_eager = _decode_layers(eager, backend, q3)

    c = _captured(lastwindow, STEADY[lastwindow])
    assert c.graphs.wants_graph(c.fb)
    o_pad = _replay(c)
    raw = c.fb.batch_size
    assert c.graphs.replays == 1 and c.runner.bs == raw
    torch.testing.assert_close(o_pad[:raw], o_eager, rtol=1e-5, atol=1e-5)
    assert float(o_pad[raw:].abs().sum()) == 0.0  # padding rows read nothing
    assert float(o_eager.abs().sum()) > 0
    assert torch.equal(c.runner.step_rows, eager.step_rows)  # same lists read: same statistics
    # the step's queries reach the rings at the next batch exactly as in the eager path
    eager._commit_ring()
    c.runner._commit_ring()
    for r_e, r_g in zip(reqs, c.reqs):
        assert torch.equal(getattr(r_e, STATE_ATTR).ring, getattr(r_g, STATE_ATTR).ring)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_steady_steps_over_the_all_layer_list_cap_replay_with_lists_written_into_the_graph(lastwindow, monkeypatch):
    """``LISTS_ALL_MAX_ENTRIES`` bounds the all-layer temporaries of an eager step. A steady step planned for a replay
    writes every layer's lists straight into the graph's static buffers (no temporary), so a batch over that cap still
    replays, with the eager step's outputs and statistics. The sort-based build (``steady_from_bases`` False) still
    builds a temporary, and keeps the cap."""
    import sglang_sparse.loopserve.runner as lr

    eager_cfg, shape, backend, fb, reqs, q3, _ = _setup(lastwindow, *STEADY[lastwindow], all_topb=True)
    eager = LoopServeRunner(eager_cfg, shape, torch.device("cpu"), use_kernels=True)
    eager.begin_batch(backend, fb)
    o_eager = _decode_layers(eager, backend, q3)

    monkeypatch.setattr(lr, "LISTS_ALL_MAX_ENTRIES", 0)
    c = _captured(lastwindow, STEADY[lastwindow])
    assert not c.runner.lists_all_fits(1, 1)
    assert c.graphs.wants_graph(c.fb)
    o_pad = _replay(c)
    raw = c.fb.batch_size
    assert c.graphs.replays == 1 and c.runner.steady_into is None
    torch.testing.assert_close(o_pad[:raw], o_eager, rtol=1e-5, atol=1e-5)
    assert float(o_pad[raw:].abs().sum()) == 0.0
    assert torch.equal(c.runner.step_rows, eager.step_rows)

    c = _captured(lastwindow, STEADY[lastwindow])
    c.runner.steady_from_bases = False
    assert not c.graphs.wants_graph(c.fb)


def _widen_lines(reqs, extra):
    """Pad every request's stored vertical and slash lines with ``extra`` empty (-1) slots: the summed list width
    grows past the context while the sets stay the same."""
    for req in reqs:
        st = getattr(req, STATE_ATTR)
        v_idx, v_cnt, s_idx, s_cnt = st.lines
        pad = lambda t: torch.nn.functional.pad(t, (0, extra), value=-1)  # noqa: E731
        st.lines = (pad(v_idx), v_cnt, pad(s_idx), s_cnt)


def test_lists_wider_than_the_graph_but_within_the_context_replay_like_the_eager_step():
    """The summed widths of lines, slashes and top-B bound a list before deduplication only; no list is longer than
    its context. A graph as wide as the longest context replays such a step, with the eager step's outputs."""
    eager_cfg, shape, backend, fb, reqs, q3, _ = _setup(False, *STEADY[False], all_topb=True)
    _widen_lines(reqs, 400)
    eager = LoopServeRunner(eager_cfg, shape, torch.device("cpu"), use_kernels=True)
    eager.begin_batch(backend, fb)
    o_eager = _decode_layers(eager, backend, q3)

    longest = max(STEADY[False][0])
    c = _captured(False, STEADY[False], width=longest)
    _widen_lines(c.reqs, 400)
    assert c.graphs.wants_graph(c.fb)  # summed width > 800 > the graph's width, the longest context
    o_pad = _replay(c)
    raw = c.fb.batch_size
    assert c.graphs.replays == 1
    torch.testing.assert_close(o_pad[:raw], o_eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(c.runner.step_rows, eager.step_rows)
    # one entry narrower than the longest context: lists that may hold every position do not fit
    c = _captured(False, STEADY[False], width=longest - 1)
    _widen_lines(c.reqs, 400)
    assert not c.graphs.wants_graph(c.fb)


def test_steps_that_select_or_do_not_fit_are_not_replayed():
    # loopserve rows at generated tokens 5 and 15 (initial top-B) and 19: selecting rows -> eager
    c = _captured(False, LOOPSERVE, all_topb=False)
    assert not c.graphs.wants_graph(c.fb)
    # steady, but the lists are wider than the captured width
    c = _captured(False, STEADY[False], width=40)
    assert not c.graphs.wants_graph(c.fb)
    # steady, but larger than the largest captured batch
    c = _captured(True, STEADY[True])
    c.fb.batch_size = MAX_BS + 1
    assert not c.graphs.wants_graph(c.fb)


def test_a_replay_without_a_planned_batch_is_refused():
    c = _captured(True, STEADY[True])
    with pytest.raises(RuntimeError, match="wants_graph"):
        _replay(c)
    # and a replay view whose lengths are not the batch can_run_graph saw
    assert c.graphs.wants_graph(c.fb)
    c.fb.seq_lens_cpu = c.fb.seq_lens_cpu + 1
    with pytest.raises(RuntimeError, match="not the one"):
        _replay(c)


def test_graph_list_width_is_the_configs_and_is_validated():
    cfg, shape, *_ = _setup(True, *STEADY[True])
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True)
    # one width for the static lists and for how every step's lists are split (eager and replayed alike)
    assert LoopServeGraphs(runner).width == runner.split_width == cfg.graph_list_width
    with pytest.raises(ValueError, match="graph_list_width"):
        LoopServeGraphs(runner, 0)


def test_graph_list_width_is_capped_at_the_served_context_length():
    """No token list is wider than the context: a server at 8k context sizes its static lists (and splits) at 8k
    under the 32k default, one at 64k keeps the configured 32k."""
    from sglang_sparse.config import LoopServeConfig

    cfg, shape, *_ = _setup(True, *STEADY[True])
    assert LoopServeConfig().graph_list_width == 32768
    cfg = dataclasses.replace(cfg, graph_list_width=32768)
    short = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True, max_context=8192)
    assert short.split_width == LoopServeGraphs(short).width == 8192
    long = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True, max_context=65536)
    assert long.split_width == LoopServeGraphs(long).width == 32768


def test_batch_sizes_above_graph_max_bs_capture_the_stock_decode_and_never_replay():
    c = _captured(True, STEADY[True], bs_cap=2)  # captures 4 (stock: no sparse dict) then 2 (sparse, buffers for 2)
    assert c.graphs.max_bs == 2 and set(c.graphs._dicts) == {2}
    assert not c.graphs.wants_graph(c.fb)  # 3 rows > 2
    with pytest.raises(ValueError, match="graph_max_bs"):
        LoopServeGraphs(c.runner, 64, max_bs=0)


def test_can_run_graph_gate_asks_the_modes_backend():
    """``api_hooks.graph_gate_hook`` (AFTER SGLang's ``can_run_graph``, installed with ``sglang_sparse.loopserve.backend``
    and psa): a graph is replayed only when SGLang allows it and the backend's ``sparse_wants_graph`` says yes."""
    from sglang_sparse.api_hooks import graph_gate_hook

    def runner_with(backend):
        return SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))

    seen = []
    wants = SimpleNamespace(sparse_wants_graph=lambda fb: seen.append(fb) or fb == "steady")
    assert graph_gate_hook(True, runner_with(wants), "steady") is True
    assert graph_gate_hook(True, runner_with(wants), "selecting") is False
    assert graph_gate_hook(False, runner_with(wants), "steady") is False and seen == ["steady", "selecting"]
    assert graph_gate_hook(True, runner_with(SimpleNamespace()), "any") is True  # a mode without a gate: stock


def _captured_select(case, width=512, select_rows=4, budget=256, lines=True):
    """A loopserve runner whose graphs are captured at batch sizes 4 and 2, each in its steady and its re-selecting
    variant (as ``graph_variants.capture_one_shape_hook`` records them), with a graph top-B width of ``budget``."""
    from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

    from sglang_sparse.graph_variants import SELECT, SPARSE

    cfg, shape, backend, fb, reqs, q3, pool = _setup(False, *case, lines=lines)
    cfg = dataclasses.replace(cfg, budget=budget)
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True)
    graphs = LoopServeGraphs(runner, width, max_bs=16, select_rows=select_rows)
    rpi_buf = torch.zeros(MAX_BS, dtype=torch.int64)
    try:
        for bs in (MAX_BS, 2):
            for label in (SPARSE, SELECT):
                _set_capture_lora_variant(label)
                view = SimpleNamespace(batch_size=bs, forward_mode=_Mode(), req_pool_indices=rpi_buf[:bs],
                                       seq_lens_cpu=torch.ones(bs, dtype=torch.int64))
                graphs.plan(backend, view, in_capture=True)
                if runner.dec is not None:  # else the backend records the stock decode under this label
                    _decode_layers(runner, backend, torch.zeros(bs, HQ, D))
    finally:
        _set_capture_lora_variant(None)
    return SimpleNamespace(runner=runner, graphs=graphs, backend=backend, fb=fb, reqs=reqs, q3=q3, rpi_buf=rpi_buf,
                           cfg=cfg)


def test_replayed_reselecting_step_decodes_and_selects_like_the_eager_step():
    """A step where rows re-select their top-B, replayed from the re-selecting graph (static selection buffers,
    padded request slots, a trash row for their top-B, the rows' bases in the steady lists' buffers): the eager
    step's outputs, statistics, committed top-B and rings; padding rows read nothing. Then a steady step and a
    second re-selecting step replay over the same buffers, as the eager steps decode."""
    c = _captured_select(LOOPSERVE)
    assert set(c.graphs._select) == {MAX_BS, 2}
    eager_cfg, shape, backend, fb, reqs, q3, _ = _setup(False, *LOOPSERVE, lines=True)
    eager = LoopServeRunner(c.cfg, shape, torch.device("cpu"), use_kernels=True)
    eager.begin_batch(backend, fb)
    assert eager.dec["fire"] == [True, True, False]
    o_eager = _decode_layers(eager, backend, q3)

    assert c.graphs.graph_variant(c.fb) == "select"
    assert c.graphs.graph_variant(c.fb, peek=True) == "select"
    o_pad = _replay(c)
    raw = c.fb.batch_size
    assert c.graphs.replays == c.graphs.select_replays == 1 and c.runner.bs == raw
    torch.testing.assert_close(o_pad[:raw], o_eager, rtol=1e-5, atol=1e-5)
    assert float(o_pad[raw:].abs().sum()) == 0.0
    assert float(o_eager.abs().sum()) > 0
    assert torch.equal(c.runner.step_rows[:raw], eager.step_rows)
    eager._commit_ring()
    c.runner._commit_ring()
    for r_e, r_g in zip(reqs, c.reqs):
        s_e, s_g = getattr(r_e, STATE_ATTR), getattr(r_g, STATE_ATTR)
        assert torch.equal(s_e.ring, s_g.ring)
        assert s_e.topb.shape == s_g.topb.shape
        # the same sets (top-k order among equal scores may differ between the padded and the eager width)
        assert torch.equal(s_e.topb.sort(-1).values, s_g.topb.sort(-1).values)
    # two more steps over the same buffers (the same lengths: the pool holds no later position), each after the
    # previous step's commit: the graph path keeps decoding like the eager one
    for step in range(1, 3):
        q_next = torch.randn(raw, HQ, D, generator=torch.Generator().manual_seed(step))
        eager.begin_batch(backend, fb)
        o_eager = _decode_layers(eager, backend, q_next)
        variant = c.graphs.graph_variant(c.fb)
        assert variant == ("sparse" if not any(eager.dec["fire"]) else "select")
        c.q3 = q_next
        o_pad = _replay(c)
        torch.testing.assert_close(o_pad[:raw], o_eager, rtol=1e-5, atol=1e-5)
        assert float(o_pad[raw:].abs().sum()) == 0.0
        eager._commit_ring()
        c.runner._commit_ring()


def test_reselecting_steps_the_graph_cannot_take_decode_eagerly():
    # two selecting rows, one slot
    c = _captured_select(LOOPSERVE, select_rows=1)
    assert c.graphs.graph_variant(c.fb) is None
    # a selecting row's budget (200) wider than the graph's top-B (16)
    c = _captured_select(LOOPSERVE, budget=16)
    assert c.graphs.graph_variant(c.fb) is None
    # a context (300) longer than the static lists
    c = _captured_select(LOOPSERVE, width=256)
    assert c.graphs.graph_variant(c.fb) is None
    # a steady step still takes the steady graph
    c = _captured_select(STEADY[False])
    assert c.graphs.graph_variant(c.fb) == "sparse"
    # select_rows 0: no re-selecting graph is recorded (the capture records the stock decode under that label)
    c = _captured_select(LOOPSERVE, select_rows=0)
    assert c.graphs._select == {} and c.graphs.graph_variant(c.fb) is None
