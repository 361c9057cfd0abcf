"""Contract: a mode whose ``min_context`` is above the served context length says so at start-up (a warning naming
the fix) and in ``/server_info`` (``engagement.reachable`` false); a reachable one is reported without a warning;
modes without ``min_context`` report nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_sparse.modes import resolve_sparse as _context_from
from sglang_sparse.runtime_hooks import engagement


def _runner(context_len):
    return SimpleNamespace(model_config=SimpleNamespace(context_len=context_len))


@pytest.mark.parametrize("mode,config,served,reachable", [
    ("psa", None, 8192, False),                       # default min_context 32768 on the 8k default model
    ("psa", '{"min_context": 4096}', 8192, True),
    ("loopserve", None, 32768, False),                # default 65536 on the 32k testbed
    ("loopserve", '{"min_context": 32768}', 32768, True),  # equal: the last position reaches it
    ("lastwindow", None, 8192, True),
])
def test_unreachable_min_context_is_reported_and_warned(mode, config, served, reachable, caplog):
    ctx = _context_from(mode, config)
    with caplog.at_level(logging.WARNING, logger="sglang_sparse"):
        got = engagement(ctx, _runner(served))
    assert got == {"min_context": ctx.config.min_context, "context_length": served, "reachable": reachable}
    warned = [r.getMessage() for r in caplog.records if "min_context" in r.getMessage()]
    if reachable:
        assert not warned
    else:
        assert len(warned) == 1 and f"min_context {ctx.config.min_context}" in warned[0]
        assert f"served context length {served}" in warned[0] and "--sparse-config" in warned[0]


def test_modes_without_min_context_or_without_a_served_length_report_nothing():
    assert engagement(_context_from("off", None), _runner(8192)) is None
    assert engagement(_context_from("samkv", None), _runner(8192)) is None
    assert engagement(_context_from("psa", None), SimpleNamespace()) is None
