"""Contract: the host-tier keys of --sparse-config are validated like the rest, listed in --help, select the
host-tier radix cache only when host_tier_gb > 0, and conflicting SGLang flags are refused before the model loads."""

from __future__ import annotations

import pytest

from sglang_sparse.host_tier.cache import BACKEND_NAME


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
    assert "--sparse samkv keeps each document's KV in the radix cache, and it is off (--disable-radix-cache)" in \
        capsys.readouterr().err


def test_samkv_is_refused_where_sglang_itself_turns_the_radix_cache_off(args, capsys):
    """SGLang turns the radix cache off by itself under --enable-deterministic-inference with the flashinfer
    backend (its deterministic mode has no radix support there); samkv would then serve every documents request
    as a fallback, so start-up is refused with one line naming the settings and the backends that keep it."""
    with pytest.raises(SystemExit) as exc:
        args("--sparse", "samkv", "--enable-deterministic-inference", "--attention-backend", "flashinfer")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sparse samkv keeps each document's KV in the radix cache" in err and "triton" in err
    # only samkv needs the cache: another mode starts with the same settings
    assert args("--sparse", "off", "--enable-deterministic-inference", "--attention-backend", "flashinfer").sparse == "off"


@pytest.mark.parametrize("mode", ["psa", "loopserve"])
def test_a_host_tier_smaller_than_one_kv_block_is_refused_at_start_naming_the_smallest_value(args, capsys, mode):
    """host_tier_gb just above 0 (inside the key's range) holds no KV block of the model: exit 2 with one line
    naming the field and the smallest useful value, before the model loads, not a scheduler traceback.
    SmolLM2-135M on CPU: 30 layers x 3 KV heads x page 1 x head_dim 64 x 2 x 2 bytes = 23040 bytes a block."""
    with pytest.raises(SystemExit) as exc:
        args("--sparse", mode, "--sparse-config", '{"host_tier_gb": 1e-6}')
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sglang: error:")]
    assert lines == [f"sglang: error: --sparse-config: field 'host_tier_gb' of mode '{mode}' = 1e-06 holds no KV "
                     "block of this model (23040 bytes: 30 layers x 3 KV heads x page 1 x head_dim 64 x 2 (K and V) "
                     "x 2 bytes); the smallest useful value is 2.15e-05 (one block), or 0 for no host tier"]
    on = args("--sparse", mode, "--sparse-config", '{"host_tier_gb": 2.15e-05}')  # the value it names starts
    assert on.radix_cache_backend == BACKEND_NAME


def test_a_gpu_unit_cache_smaller_than_one_unit_is_refused_at_start(args, capsys):
    with pytest.raises(SystemExit) as exc:
        args("--sparse", "psa", "--sparse-config", '{"host_tier_gb": 0.5, "gpu_cache_mb": 1e-9}')
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "field 'gpu_cache_mb' of mode 'psa' = 1e-09 holds less than one KV page of all layers" in err
    assert "the smallest useful value is 0.022" in err  # 23040 bytes = 0.02197 MiB
