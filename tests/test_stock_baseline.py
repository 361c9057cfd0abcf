"""Contract: the benches' ``stock`` pseudo-mode launches plain SGLang: no ``--sparse`` flag, and an environment in
which SGLang's own plugin loader skips the sglang_sparse plugin (checked with SGLang's loader in a fresh process, as
a server's processes would run it). ``off`` keeps the plugin; a sparse config for ``stock`` is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.server import STOCK, Server, ServerSpec

_LOADED = ("from sglang.srt.plugins import load_plugins_by_group, GENERAL_PLUGINS_GROUP; "
           "print(','.join(sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))))")


def _spec(mode: str, **kw) -> ServerSpec:
    return ServerSpec(python=sys.executable, model="m", device="cuda", port=31240, mode=mode, **kw)


def _plugins_loaded_under(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _LOADED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [p for p in out.stdout.strip().splitlines()[-1].split(",") if p] if out.stdout.strip() else []


def test_stock_launches_without_the_sparse_flag_and_off_with_it():
    stock = _spec(STOCK).argv()
    off = _spec("off").argv()
    assert "--sparse" not in stock and "--sparse-config" not in stock
    assert off[off.index("--sparse") + 1] == "off"
    assert stock[:3] == [sys.executable, "-m", "sglang.launch_server"]


def test_stock_environment_makes_sglangs_loader_skip_the_plugin(tmp_path):
    stock_env = Server(_spec(STOCK), tmp_path / "stock.log").environment()
    off_env = Server(_spec("off"), tmp_path / "off.log").environment()
    assert "sglang_sparse" in _plugins_loaded_under(off_env)
    assert _plugins_loaded_under(stock_env) == []


def test_stock_refuses_a_sparse_config():
    with pytest.raises(ValueError, match="stock"):
        _spec(STOCK, sparse_config='{"epsilon": 0.9}').argv()
