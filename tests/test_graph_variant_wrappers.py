"""Contract: with two or three decode graphs per batch size (``sglang_sparse.graph_variants``), each variant's replay
plans the stock decode wrappers that variant's capture created, not the last ones captured for that size.

SGLang's FlashInfer backend (CUDA only) creates a wrapper set at each capture of a size and plans only the slot
``decode_cuda_graph_metadata[bs]`` at replay; the table below behaves the same way, so the test fails when
:func:`plan_variant_graph` is bypassed (a sparse graph would replay wrappers nobody plans). The GPU form runs in
``tests/test_gpu_psa_deterministic_mixed.py`` (psa ``stock_rows`` exact: the stock decode inside the sparse graphs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_sparse.graph_variants import plan_variant_graph


class _Mode:
    def __init__(self, decode: bool):
        self._decode = decode

    def is_decode_or_idle(self) -> bool:
        return self._decode


class _StockTable:
    """What SGLang 0.5.17's FlashInfer ``init_forward_metadata_out_graph`` does to its wrapper table: a capture
    creates a new wrapper set for the size; every call plans the set in the size's slot."""

    def __init__(self):
        self.decode_cuda_graph_metadata = {}
        self.created = 0
        self.planned = []

    def out_graph(self, fb, in_capture: bool):
        bs = fb.batch_size
        if in_capture:
            self.created += 1
            self.decode_cuda_graph_metadata[bs] = [f"wrappers#{self.created}"]
        self.planned.append(self.decode_cuda_graph_metadata[bs][0])


def _batch(bs: int, decode: bool = True):
    return SimpleNamespace(batch_size=bs, forward_mode=_Mode(decode))


def _call(backend, fb, in_capture, variant):
    plan_variant_graph(backend, fb, in_capture, variant, lambda: backend.out_graph(fb, in_capture))


def test_each_variant_replay_plans_the_wrappers_of_its_own_capture():
    backend = _StockTable()
    for bs in (1, 2, 4):
        for variant in ("sparse", "select", "dense"):  # SGLang's capture order: the stock variant last
            _call(backend, _batch(bs), True, variant)
    backend.planned.clear()
    for bs, variant, expected in ((2, "sparse", "wrappers#4"), (2, "select", "wrappers#5"), (2, "dense", "wrappers#6"),
                                  (4, "sparse", "wrappers#7"), (1, "dense", "wrappers#3")):
        _call(backend, _batch(bs), False, variant)
        assert backend.planned[-1] == expected, (bs, variant)
        assert backend.decode_cuda_graph_metadata[bs] == [expected]


@pytest.mark.parametrize("variant,decode", [(None, True), ("sparse", False)])
def test_one_variant_or_non_decode_batches_call_the_stock_planning_unchanged(variant, decode):
    backend = _StockTable()
    backend.decode_cuda_graph_metadata[2] = ["mine"]
    _call(backend, _batch(2, decode), False, variant)
    assert backend.planned == ["mine"] and "_sparse_variant_wrappers" not in vars(backend)


def test_backends_without_a_wrapper_table_are_left_alone():
    calls = []
    plan_variant_graph(SimpleNamespace(), _batch(2), True, "sparse", lambda: calls.append(1))
    assert calls == [1]
