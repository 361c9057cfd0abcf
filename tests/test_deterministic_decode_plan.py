"""Contract: under deterministic inference, a sparse mode's FlashInfer backend plans every eager decode batch as SGLang
replays its decode graphs (no KV split), so stock rows of batches the mode runs eagerly match `--sparse off`'s
replayed steps; non-deterministic backends are left alone. The GPU test of the outputs is
tests/test_gpu_deterministic_mixed_decode.py."""

from __future__ import annotations

import inspect
import types

from sglang_sparse.deterministic import plan_eager_decode_like_replay


class _Updater:
    """Records the keyword arguments of SGLang's ``FlashInferIndicesUpdaterDecode.update`` calls (FlashInfer has no
    CPU build, so the backend itself cannot be constructed here)."""

    def __init__(self):
        self.calls = []
        self.update = self.update_single_wrapper  # as SGLang dispatches it in __init__

    def update_single_wrapper(self, *args, fixed_split_size=None, disable_split_kv=None, **kwargs):
        self.calls.append((fixed_split_size, disable_split_kv))


def _backend(deterministic: bool):
    return types.SimpleNamespace(disable_cuda_graph_kv_split=deterministic, indices_updater_decode=_Updater())


def _eager(b, bs):
    b.indices_updater_decode.update(list(range(bs)), fixed_split_size=2048, disable_split_kv=False)


def _graph(b, bs):
    b.indices_updater_decode.update(list(range(bs)), fixed_split_size=None, disable_split_kv=True)


def test_deterministic_eager_decode_of_replayable_sizes_is_planned_unsplit_like_replay():
    b = _backend(True)
    assert plan_eager_decode_like_replay(b) is True
    assert plan_eager_decode_like_replay(b) is True  # idempotent: wrapped once
    for bs in (4, 2, 1):  # SGLang captures its decode graphs, largest size first
        _graph(b, bs)
    _eager(b, 3)  # a mixed batch of a size off replays
    _graph(b, 2)
    _eager(b, 5)  # above the captured sizes: off decodes it eagerly, split, too
    calls = b.indices_updater_decode.calls
    assert calls[3] == (None, True) and calls[4] == (None, True) and calls[5] == (2048, False)
    assert b.indices_updater_decode.update.forced == 1


def test_without_decode_graphs_eager_decode_keeps_the_split_plan_off_runs():
    b = _backend(True)  # --disable-cuda-graph: SGLang never plans unsplit, off decodes every batch split
    plan_eager_decode_like_replay(b)
    _eager(b, 1)
    assert b.indices_updater_decode.calls == [(2048, False)]


def test_non_deterministic_backends_keep_their_decode_plan():
    b = _backend(False)
    assert plan_eager_decode_like_replay(b) is False
    _graph(b, 4)
    _eager(b, 1)
    assert b.indices_updater_decode.calls == [(None, True), (2048, False)]
    assert plan_eager_decode_like_replay(types.SimpleNamespace()) is False  # not a FlashInfer backend


def test_sglang_flashinfer_backend_plans_eager_and_replayed_decode_as_the_wrapper_assumes():
    """The installed SGLang passes the batch first and both plan arguments by keyword through
    ``indices_updater_decode.update``, split for eager decode and unsplit for replay, and marks deterministic mode
    with ``disable_cuda_graph_kv_split``."""
    from sglang.srt.layers.attention import flashinfer_backend as fb

    eager = " ".join(inspect.getsource(fb.FlashInferAttnBackend.init_forward_metadata).split())
    assert "self.indices_updater_decode.update( forward_batch.req_pool_indices," in eager  # first, by position
    assert "fixed_split_size=self.decode_split_tile_size" in eager and "disable_split_kv=False" in eager
    replay = " ".join(inspect.getsource(fb.FlashInferAttnBackend.init_forward_metadata_out_graph).split())
    assert "self.indices_updater_decode.update( req_pool_indices[:bs]," in replay  # capture and replay
    assert "fixed_split_size=None" in replay and "disable_split_kv=self.disable_cuda_graph_kv_split" in replay
    init = inspect.getsource(fb.FlashInferAttnBackend.__init__)
    assert "self.disable_cuda_graph_kv_split = True" in init
