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


def test_deterministic_eager_decode_is_planned_unsplit_like_replay():
    b = _backend(True)
    assert plan_eager_decode_like_replay(b) is True
    assert plan_eager_decode_like_replay(b) is True  # idempotent: wrapped once
    b.indices_updater_decode.update("req_pool_indices", fixed_split_size=2048, disable_split_kv=False)  # eager
    b.indices_updater_decode.update("req_pool_indices", fixed_split_size=None, disable_split_kv=True)   # replay
    assert b.indices_updater_decode.calls == [(None, True), (None, True)]


def test_non_deterministic_backends_keep_their_decode_plan():
    b = _backend(False)
    assert plan_eager_decode_like_replay(b) is False
    b.indices_updater_decode.update("req_pool_indices", fixed_split_size=None, disable_split_kv=False)
    assert b.indices_updater_decode.calls == [(None, False)]
    assert plan_eager_decode_like_replay(types.SimpleNamespace()) is False  # not a FlashInfer backend


def test_sglang_flashinfer_backend_plans_eager_and_replayed_decode_as_the_wrapper_assumes():
    """The installed SGLang passes both plan arguments by keyword through ``indices_updater_decode.update``, split
    for eager decode and unsplit for replay, and marks deterministic mode with ``disable_cuda_graph_kv_split``."""
    from sglang.srt.layers.attention import flashinfer_backend as fb

    eager = inspect.getsource(fb.FlashInferAttnBackend.init_forward_metadata)
    assert "self.indices_updater_decode.update(" in eager
    assert "fixed_split_size=self.decode_split_tile_size" in eager and "disable_split_kv=False" in eager
    replay = inspect.getsource(fb.FlashInferAttnBackend.init_forward_metadata_out_graph)  # capture and replay
    assert "fixed_split_size=None" in replay and "disable_split_kv=self.disable_cuda_graph_kv_split" in replay
    init = inspect.getsource(fb.FlashInferAttnBackend.__init__)
    assert "self.disable_cuda_graph_kv_split = True" in init
