"""Contract: a mode whose ``min_context`` is above the longest sequence a request can reach (SGLang's ``max_req_len``)
says so at start-up (a warning naming the fix) and in ``/server_info`` (``engagement.reachable`` false), and is left
dormant: the stock attention backend untouched, so the server runs exactly as ``--sparse off``; a reachable one is
reported without a warning and installed; modes without ``min_context`` report nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_sparse.modes import resolve_sparse as _context_from
from sglang_sparse.runtime_hooks import engagement


def _runner(context_len, pool=None):
    return SimpleNamespace(model_config=SimpleNamespace(context_len=context_len), max_total_num_tokens=pool)


@pytest.mark.parametrize("mode,config,served,reachable", [
    ("psa", None, 8192, False),                       # default min_context 32768 on the 8k default model
    ("psa", '{"min_context": 4096}', 8192, True),
    ("loopserve", None, 32768, False),                # default 65536 on the 32k testbed
    ("loopserve", '{"min_context": 32767}', 32768, True),   # SGLang's max_req_len: context_len - 1
    ("psa", '{"min_context": 32768}', 32768, False),       # equal to the context length: no request gets there
    ("lastwindow", None, 8192, False),                # default 65536: the baseline engages only when asked
    ("lastwindow", '{"min_context": 4096}', 8192, True),
])
def test_unreachable_min_context_is_reported_and_warned(mode, config, served, reachable, caplog):
    ctx = _context_from(mode, config)
    with caplog.at_level(logging.WARNING, logger="sglang_sparse"):
        got = engagement(ctx, _runner(served))
    assert got == {"min_context": ctx.config.min_context, "context_length": served, "longest_sequence": served - 1,
                   "reachable": reachable}
    warned = [r.getMessage() for r in caplog.records if "min_context" in r.getMessage()]
    if reachable:
        assert not warned
    else:
        assert len(warned) == 1 and f"min_context {ctx.config.min_context}" in warned[0]
        assert f"served context length {served}" in warned[0] and "--sparse-config" in warned[0]


def test_a_kv_pool_smaller_than_the_context_bounds_the_longest_sequence():
    ctx = _context_from("psa", '{"min_context": 4096}')
    assert engagement(ctx, _runner(8192, pool=4097))["reachable"]
    got = engagement(ctx, _runner(8192, pool=4096))
    assert got["longest_sequence"] == 4095 and not got["reachable"]


class _StockBackend:
    """Stands for a constructed stock attention backend (the hook only reads and sets attributes on it)."""


def _model_runner(context_len, backend, sparse_config=None):
    args = SimpleNamespace(page_size=1, enable_metrics=False, sparse="psa", sparse_config=sparse_config)
    return SimpleNamespace(model_config=SimpleNamespace(context_len=context_len), max_total_num_tokens=None,
                           attn_backend=backend, decode_attn_backend=backend, server_args=args)


def test_an_unreachable_mode_is_left_dormant_on_the_stock_backend():
    """The installer is not run: no subclass, no graph variants, no step rows (the hooks find none of the mode's
    methods and fall through to SGLang's answers), so the server runs as --sparse off does."""
    from sglang_sparse.runtime_hooks import attention_backend_hook

    backend = _StockBackend()
    attention_backend_hook(None, _model_runner(8192, backend))  # psa's default min_context 32768 on the 8k model
    assert type(backend) is _StockBackend and backend.sparse_installed_mode == "psa"
    assert backend.sparse_engagement == {"min_context": 32768, "context_length": 8192, "longest_sequence": 8191,
                                         "reachable": False, "dormant": True}
    for method in ("sparse_graph_variant", "sparse_wants_graph", "psa_step_rows", "sparse_note_prefill_graph"):
        assert not hasattr(backend, method)
