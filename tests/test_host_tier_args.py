"""Contract: the host-tier keys of --sparse-config are validated like the rest, listed in --help, select the
host-tier radix cache only when host_tier_gb > 0, and conflicting SGLang flags are refused before the model loads."""

from __future__ import annotations

import pytest

from sglang_sparse.host_tier import BACKEND_NAME


@pytest.fixture(scope="module")
def prepare():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.server_args as sa

    return sa.prepare_server_args


@pytest.fixture(scope="module")
def args(prepare, default_model):
    return lambda *argv: prepare(["--model-path", str(default_model), "--device", "cpu", *argv])


@pytest.mark.parametrize("mode", ["psa", "loopserve"])
def test_host_tier_selects_the_backend_only_when_on(args, mode):
    on = args("--sparse", mode, "--sparse-config", '{"host_tier_gb": 0.5, "gpu_cache_mb": 32}')
    assert on.radix_cache_backend == BACKEND_NAME
    assert '"host_tier_gb": 0.5' in on.sparse_config and '"working_set_window": 12' in on.sparse_config
    off = args("--sparse", mode)
    assert off.radix_cache_backend is None and '"host_tier_gb": 0.0' in off.sparse_config


@pytest.mark.parametrize("argv,fragment", [
    (["--sparse-config", '{"host_tier_gb": 1}', "--disable-radix-cache"],
     "host_tier_gb=1.0 cannot be used with --disable-radix-cache"),
    (["--sparse-config", '{"host_tier_gb": 1}', "--enable-hierarchical-cache"],
     "host_tier_gb=1.0 cannot be used with --enable-hierarchical-cache"),
    (["--sparse-config", '{"host_tier_gb": -1}'], "field 'host_tier_gb' of mode 'psa' = -1.0 is out of range; "
                                                  "allowed range [0, 4096]"),
    (["--sparse-config", '{"gpu_cache_mb": 0}'], "field 'gpu_cache_mb' of mode 'psa' = 0.0 is out of range"),
    (["--sparse-config", '{"working_set_window": 0}'], "field 'working_set_window' of mode 'psa' = 0 is out of range"),
])
def test_bad_host_tier_settings_are_refused(args, capsys, argv, fragment):
    with pytest.raises(SystemExit) as exc:
        args("--sparse", "psa", *argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_help_text_lists_the_host_tier_keys():
    from sglang_sparse.server_args import _config_help

    text = _config_help()
    for frag in ("host_tier_gb=0.0 [0, 4096]", "gpu_cache_mb=64.0 (0, 1048576]", "working_set_window=12 [1, 256]"):
        assert frag in text


def test_samkv_without_radix_cache_is_refused_at_start(args, capsys):
    """samkv keeps documents in the radix cache: with --disable-radix-cache it would serve every documents
    request as a fallback, so it is refused before the model loads."""
    with pytest.raises(SystemExit) as exc:
        args("--sparse", "samkv", "--disable-radix-cache")
    assert exc.value.code == 2
    assert "--sparse samkv" in capsys.readouterr().err
