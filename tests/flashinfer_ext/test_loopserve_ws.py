"""Contract: a LoopServe decode step records its working set (sglang_sparse.loopserve.ws): after the step, each
sparse row's tracker slot holds, per layer and KV head, exactly the blocks (token // block_size) of the tokens
that layer's split-list decode attended; the kernel path (Triton under the interpreter on the CPU) and the
reference path record the same units; a graph-replayed steady step (capture over the trash row, replay planned
before it) records what the eager step records, its padding rows only into the trash row.

Runs the runner on the SGLang-shaped stand-ins of test_loopserve_reselect (no sglang import)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashinfer_ext.host_tier.ws_record import ws_record_tokens, ws_record_tokens_reference
from radix_sparse.working_set_tracker import WorkingSetTracker
from sglang_sparse.loopserve.graph import LoopServeGraphs
from sglang_sparse.loopserve.runner import LoopServeRunner
from sglang_sparse.loopserve.ws import LoopServeWorkingSet

from .test_loopserve_graph import MAX_BS, _decode_layers, _replay
from .test_loopserve_reselect import HK, HQ, LOOPSERVE, STEADY, D, L, _Mode, _setup

_NEVER = -(1 << 30)


def _runner(case, use_kernels, block_size, all_topb=True):
    cfg, shape, backend, fb, reqs, q3, pool = _setup(False, *case, all_topb=all_topb)
    for j, r in enumerate(reqs):
        r.rid = f"req{j}"
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=use_kernels)
    tracker = WorkingSetTracker(num_slots=4, num_layers=L, num_kv_heads=HK,
                                max_blocks=-(-pool.req_to_token.shape[1] // block_size), window=4,
                                max_batch_size=MAX_BS, token_record_kernel=ws_record_tokens if use_kernels else ws_record_tokens_reference,
                                order_buffers=False)
    runner.ws = LoopServeWorkingSet(tracker, block_size, min_context=0)
    return runner, SimpleNamespace(backend=backend, fb=fb, reqs=reqs, q3=q3, pool=pool)


def _units(tracker, rid):
    """{(layer, head): set of blocks} stamped at the slot's current step."""
    s = tracker.tracked[rid]
    stamps = tracker.stamp_buf[s, :, :, : tracker.max_blocks]
    step = int(tracker.step_buf[s])
    return {(lid, h): set(torch.nonzero(stamps[lid, h] == step).flatten().tolist())
            for lid in range(L) for h in range(HK)}


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_a_steady_step_records_the_blocks_of_the_lists_it_attended(use_kernels, block_size):
    runner, env = _runner(STEADY[False], use_kernels, block_size)
    runner.begin_batch(env.backend, env.fb)
    _decode_layers(runner, env.backend, env.q3)
    lists, lens = runner.dec["lists_all"]  # [L, nS, Hk, W], [L, nS, Hk]: what every layer attended
    tr = runner.ws.tracker
    for j, r in enumerate(env.reqs):
        got = _units(tr, r.rid)
        for lid in range(L):
            for h in range(HK):
                want = {int(t) // block_size for t in lists[lid, j, h, : int(lens[lid, j, h])]}
                assert got[(lid, h)] == want and want
    assert tr.sizes([r.rid for r in env.reqs]) == [sum(len(v) for v in _units(tr, r.rid).values()) for r in env.reqs]


def test_a_reselection_step_records_the_same_units_on_the_kernel_and_the_reference_path():
    """Rows re-selecting top-B (each layer's lists built in decode: union_append / decode_union_merge)."""
    units = []
    for use_kernels in (False, True):
        runner, env = _runner(LOOPSERVE, use_kernels, 16, all_topb=False)
        runner.begin_batch(env.backend, env.fb)
        assert runner.dec["sel"] is not None
        _decode_layers(runner, env.backend, env.q3)
        units.append([_units(runner.ws.tracker, r.rid) for r in env.reqs])
        sizes = runner.ws.tracker.sizes([r.rid for r in env.reqs])
        assert all(s and s > 0 for s in sizes), sizes
    assert units[0] == units[1]


def test_a_batch_without_sparse_rows_does_not_record_and_absent_requests_release_their_slots():
    runner, env = _runner(STEADY[False], False, 16)
    runner.begin_batch(env.backend, env.fb)
    _decode_layers(runner, env.backend, env.q3)
    tr = runner.ws.tracker
    assert set(tr.tracked) == {r.rid for r in env.reqs}
    # the next decode batch carries only the first request: the others finished, their slots are free again
    fb1 = SimpleNamespace(forward_mode=_Mode(), batch_size=1, sampling_info=SimpleNamespace(sparse_reqs=env.reqs[:1]),
                          seq_lens_cpu=env.fb.seq_lens_cpu[:1] + 1, req_pool_indices=env.fb.req_pool_indices[:1])
    runner.begin_batch(env.backend, fb1)
    assert set(tr.tracked) == {"req0"} and runner.ws.active
    # an empty batch plans nothing: no step is recorded
    runner.begin_batch(env.backend, SimpleNamespace(forward_mode=_Mode(), batch_size=0, sampling_info=None))
    assert not runner.ws.active


def test_a_graph_replayed_step_records_what_the_eager_step_records():
    eager, env_e = _runner(STEADY[False], True, 16)
    eager.begin_batch(env_e.backend, env_e.fb)
    _decode_layers(eager, env_e.backend, env_e.q3)

    runner, env = _runner(STEADY[False], True, 16)
    graphs = LoopServeGraphs(runner, 256, max_bs=16)
    rpi_buf = torch.zeros(MAX_BS, dtype=torch.int64)
    tr = runner.ws.tracker
    for bs in (MAX_BS, 2):  # capture: SGLang's largest size first; the captured forwards write the trash row only
        view = SimpleNamespace(batch_size=bs, forward_mode=_Mode(), req_pool_indices=rpi_buf[:bs],
                               seq_lens_cpu=torch.ones(bs, dtype=torch.int64))
        graphs.plan(env.backend, view, in_capture=True)
        _decode_layers(runner, env.backend, torch.zeros(bs, HQ, D))
    assert not tr.tracked and bool(tr.stamp_buf[: tr.num_slots].eq(_NEVER).all())
    c = SimpleNamespace(runner=runner, graphs=graphs, backend=env.backend, fb=env.fb, reqs=env.reqs, q3=env.q3,
                        rpi_buf=rpi_buf)
    assert graphs.wants_graph(env.fb)
    _replay(c)  # padded to 4 rows: the 4th writes the trash row
    assert graphs.replays == 1
    for r_e, r_g in zip(env_e.reqs, env.reqs):
        got = _units(tr, r_g.rid)
        assert got == _units(eager.ws.tracker, r_e.rid) and all(got.values())
    assert tr.sizes([r.rid for r in env.reqs]) == eager.ws.tracker.sizes([r.rid for r in env_e.reqs])
