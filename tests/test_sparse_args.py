"""Contract: --sparse / --sparse-config are parsed, validated and refused with a message
that names the field, the value and the allowed range — before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_sparse.config import LoopServeConfig, PsaConfig, SamKVConfig, SparseConfigError
from sglang_sparse.modes import MODES, implemented_modes, load_config_arg, resolve_sparse
from tests.serverproc import DEFAULT_MODEL, server_env


@pytest.fixture(scope="module")
def prepare():
    """SGLang's real CLI entry (`prepare_server_args`) with the plugin loaded in this process."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.server_args as sa

    return sa.prepare_server_args


# (argv after --model-path, fragments the error message must contain)
CLI_BAD_INPUTS = [
    (["--sparse", "bogus"], ["unknown --sparse mode 'bogus'", "implemented modes: off, psa"]),
    (["--sparse", "samkv", "--sparse-config", '{"variant": "bogus"}'],
     ["field 'variant' of mode 'samkv' = 'bogus' is not allowed",
      "choose one of ['samkv', 'reuse', 'recompute', 'cacheblend']"]),
    (["--sparse", "psa", "--sparse-config", '{"epsilon": 2}'], ["field 'epsilon' of mode 'psa' = 2.0 is out of "
                                                              "range; allowed range (0, 1]"]),
    (["--sparse", ""], ["unknown --sparse mode ''", "implemented modes: off, psa"]),
    (["--sparse-config", "{not json"], ["--sparse-config is not valid JSON", "line 1 column 2"]),
    (["--sparse-config", "[1, 2]"], ["must be a JSON object", "got list"]),
    (["--sparse-config", "@/nonexistent/sparse.json"], ["'/nonexistent/sparse.json' cannot be read",
                                                        "No such file"]),
    (["--sparse", "off", "--sparse-config", '{"epsilon": 0.9}'],
     ["unknown key(s) 'epsilon' for mode 'off'", "allowed keys: none"]),
]


@pytest.mark.parametrize("argv,fragments", CLI_BAD_INPUTS, ids=[" ".join(a)[:40] for a, _ in CLI_BAD_INPUTS])
def test_cli_rejects_bad_sparse_input_with_message(prepare, capsys, argv, fragments):
    with pytest.raises(SystemExit) as exc:
        prepare(["--model-path", str(DEFAULT_MODEL), "--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for frag in fragments:
        assert frag in err, f"{frag!r} not in stderr:\n{err}"


def test_cli_reads_config_file_and_rejects_its_bad_json(prepare, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": }')
    with pytest.raises(SystemExit):
        prepare(["--model-path", str(DEFAULT_MODEL), "--sparse-config", f"@{bad}"])
    assert f"--sparse-config file '{bad}' is not valid JSON" in capsys.readouterr().err


def test_cli_accepts_off_and_resolves_config_to_canonical_json(prepare, default_model, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    args = prepare(["--model-path", str(default_model), "--device", "cpu", "--sparse", "off",
                    "--sparse-config", f"@{empty}"])
    assert type(args).__name__ == "SparseServerArgs"
    assert args.sparse == "off" and args.sparse_config == "{}"


def test_default_mode_is_off(prepare, default_model):
    args = prepare(["--model-path", str(default_model), "--device", "cpu"])
    assert args.sparse == "off" and args.sparse_config == "{}"


CONFIG_BAD_INPUTS = [
    (PsaConfig, {"epsilon": 1.5}, "field 'epsilon' of mode 'psa' = 1.5 is out of range; allowed range (0, 1]"),
    (PsaConfig, {"epsilon": 0}, "field 'epsilon' of mode 'psa' = 0.0 is out of range; allowed range (0, 1]"),
    (PsaConfig, {"epsilon": "high"}, "field 'epsilon' of mode 'psa' = \"high\" must be a number in (0, 1], got string"),
    (PsaConfig, {"micro_batch_blocks": 2.5}, "'micro_batch_blocks' of mode 'psa' = 2.5 must be an integer, "
                                             "one of [1, 2, 4, 8"),
    (PsaConfig, {"micro_batch_blocks": 6}, "'micro_batch_blocks' of mode 'psa' = 6 is not allowed; choose one of "
                                           "[1, 2, 4, 8, 16"),
    (PsaConfig, {"sink_pages": True}, "'sink_pages' of mode 'psa' = true must be an integer in [0, 1024], got boolean"),
    (PsaConfig, {"local_pages": -1}, "'local_pages' of mode 'psa' = -1 is out of range; allowed range [0, 1024]"),
    (PsaConfig, {"epsilon": float("nan")}, "'epsilon' of mode 'psa' = nan is not a finite number"),
    (PsaConfig, {"eps": 0.9}, "unknown key(s) 'eps' for mode 'psa'; allowed keys: block_size, calib_slack, cuda_graph, "
                                "dense_above, epsilon, estimator, gpu_cache_mb, host_tier_gb"),
    (LoopServeConfig, {"n_d": 0}, "'n_d' of mode 'loopserve' = 0 is out of range; allowed range [1, 4096]"),
    (LoopServeConfig, {"alpha": None}, "'alpha' of mode 'loopserve' = null must be a number in (0, 1], got null"),
    (SamKVConfig, {"fuse": "blend"}, "'fuse' of mode 'samkv' = 'blend' is not allowed; choose one of "
                                     "['overwrite', 'fusion']"),
    (SamKVConfig, {"block_size": 0}, "'block_size' of mode 'samkv' = 0 is out of range; allowed range [1, 4096]"),
]


@pytest.mark.parametrize("cls,raw,message", CONFIG_BAD_INPUTS, ids=[json.dumps(r)[:30] for _, r, _ in CONFIG_BAD_INPUTS])
def test_mode_config_rejects_bad_value_naming_field_value_and_range(cls, raw, message):
    with pytest.raises(SparseConfigError) as exc:
        cls.from_dict(raw)
    assert message in str(exc.value)


def test_mode_configs_are_frozen_and_fill_defaults():
    cfg = PsaConfig.from_dict({"epsilon": 1})
    assert cfg.epsilon == 1.0 and isinstance(cfg.epsilon, float) and cfg.micro_batch_blocks == 8
    with pytest.raises(Exception):
        cfg.epsilon = 0.5  # frozen
    assert json.loads(LoopServeConfig.from_dict({}).to_json())["alpha"] == 0.99


def test_registry_lists_implemented_modes_and_every_config_matches_its_mode():
    assert implemented_modes() == ["off", "psa", "loopserve", "lastwindow", "samkv"]
    assert {"off", "psa", "loopserve", "lastwindow", "samkv"} <= set(MODES)
    for name, spec in MODES.items():
        assert spec.config_cls.mode == name
    with pytest.raises(TypeError):
        MODES["x"] = MODES["off"]  # the registry is read-only


def test_resolve_accepts_dict_json_and_none():
    assert resolve_sparse("off", None).to_dict() == {"mode": "off", "config": {}}
    assert resolve_sparse("off", {}).is_dense
    assert load_config_arg('  {"a": 1} ') == {"a": 1}
    with pytest.raises(SparseConfigError, match="must be a mode name"):
        resolve_sparse(3, None)


def test_modes_on_cuda_set_the_server_settings_they_need():
    from types import SimpleNamespace

    from sglang_sparse.modes import resolve_sparse
    from sglang_sparse.server_args import _apply_mode_requirements

    def args(device="cuda"):
        return SimpleNamespace(device=device, page_size=None, disable_cuda_graph=False,
                               disable_prefill_cuda_graph=False, cuda_graph_backend_prefill=None)

    a = args()  # the default (breakable) prefill graphs run attention eagerly: they stay on
    _apply_mode_requirements(a, resolve_sparse("psa", '{"block_size": 32}'))
    # page size 1 stays (metadata rows per request block)
    assert (a.page_size, a.disable_prefill_cuda_graph, a.disable_cuda_graph) == (None, False, False)
    a = args()  # with the host tier the page is the block
    _apply_mode_requirements(a, resolve_sparse("psa", '{"block_size": 32, "host_tier_gb": 0.5}'))
    assert a.page_size == 32
    a = args()
    a.page_size = 32  # an explicit page of the block's size is kept
    _apply_mode_requirements(a, resolve_sparse("psa", '{"block_size": 32}'))
    assert a.page_size == 32
    a = args()
    _apply_mode_requirements(a, resolve_sparse("psa", '{"prefill_graphs": false}'))
    assert a.disable_prefill_cuda_graph
    a = args()
    a.cuda_graph_backend_prefill = "full"  # captures attention: the sparse prefill cannot plan inside it
    _apply_mode_requirements(a, resolve_sparse("psa", None))
    assert a.disable_prefill_cuda_graph
    a = args()
    _apply_mode_requirements(a, resolve_sparse("psa", '{"cuda_graph": false}'))
    assert (a.page_size, a.disable_cuda_graph) == (None, True)
    cpu = args("cpu")
    _apply_mode_requirements(cpu, resolve_sparse("psa", None))
    assert (cpu.page_size, cpu.disable_cuda_graph, cpu.disable_prefill_cuda_graph) == (None, False, False)
    for mode in ("loopserve", "lastwindow"):  # decode graphs stay on (steady steps replay them), breakable prefill too
        a = args()
        _apply_mode_requirements(a, resolve_sparse(mode, None))
        assert (a.disable_cuda_graph, a.disable_prefill_cuda_graph, a.page_size) == (False, False, None)
        for backend in ("full", "tc_piecewise"):
            a = args()
            a.cuda_graph_backend_prefill = backend
            _apply_mode_requirements(a, resolve_sparse(mode, None))
            assert a.disable_prefill_cuda_graph, (mode, backend)
        a = args()
        _apply_mode_requirements(a, resolve_sparse(mode, '{"prefill_graphs": false}'))
        assert a.disable_prefill_cuda_graph
    a = args()
    a.disable_overlap_schedule = False
    # the assembly synchronises before its KV access; the question's prefill over the composite is an ordinary
    # prefix hit, which the breakable prefill graphs replay with attention eager
    _apply_mode_requirements(a, resolve_sparse("samkv", None))
    assert (a.disable_overlap_schedule, a.disable_prefill_cuda_graph, a.disable_cuda_graph) == (False, False, False)
    a = args()
    a.disable_overlap_schedule = False
    _apply_mode_requirements(a, resolve_sparse("samkv", '{"overlap_schedule": false}'))
    assert (a.disable_overlap_schedule, a.disable_prefill_cuda_graph) == (True, False)
    a = args()
    a.disable_overlap_schedule = False
    _apply_mode_requirements(a, resolve_sparse("samkv", '{"prefill_graphs": false}'))
    assert (a.disable_overlap_schedule, a.disable_prefill_cuda_graph) == (False, True)
    for backend in ("full", "tc_piecewise"):
        a = args()
        a.disable_overlap_schedule = False
        a.cuda_graph_backend_prefill = backend
        _apply_mode_requirements(a, resolve_sparse("samkv", None))
        assert a.disable_prefill_cuda_graph, backend
    cpu = args("cpu")
    cpu.disable_overlap_schedule = False
    _apply_mode_requirements(cpu, resolve_sparse("samkv", None))
    assert (cpu.disable_overlap_schedule, cpu.disable_prefill_cuda_graph) == (False, False)
    with pytest.raises(SparseConfigError, match="must be one of \\[16, 32, 64\\]"):
        _apply_mode_requirements(args(), resolve_sparse("psa", '{"block_size": 8}'))


def test_psa_on_cuda_refuses_a_page_size_other_than_one_or_its_block(prepare, default_model, capsys):
    with pytest.raises(SystemExit):
        prepare(["--model-path", str(default_model), "--device", "cuda", "--sparse", "psa", "--page-size", "64"])
    assert "--page-size 64 must be 1 or equal block_size 16" in capsys.readouterr().err


def test_engine_refuses_bad_mode_before_loading_the_model(prepare, default_model):
    import sglang as sgl

    from sglang_sparse.server_args import SparseServerArgs

    assert sgl.Engine.server_args_class is SparseServerArgs
    with pytest.raises(SparseConfigError, match="'variant' of mode 'samkv' = 'bogus' is not allowed"):
        sgl.Engine(model_path=str(default_model), device="cpu", sparse="samkv", sparse_config={"variant": "bogus"})
    with pytest.raises(SparseConfigError, match="unknown key"):
        sgl.Engine(model_path=str(default_model), device="cpu", sparse="off", sparse_config={"budget": 3})


@pytest.mark.parametrize("argv,fragment", [
    (["--sparse", "samkv", "--sparse-config", '{"block_size": 0}'],
     "field 'block_size' of mode 'samkv' = 0 is out of range; allowed range [1, 4096]"),
    (["--sparse-config", '{"alpha": 0.9}'], "unknown key(s) 'alpha' for mode 'off'"),
])
def test_launch_server_exits_nonzero_with_message_on_bad_sparse(default_model, argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(default_model),
                           "--device", "cpu", *argv], capture_output=True, text=True, timeout=120, env=server_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert fragment in proc.stderr
    assert "Load weight" not in proc.stderr + proc.stdout  # refused before the model loads


def test_help_lists_both_flags(default_model):
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
                          text=True, timeout=120, env=server_env())
    assert proc.returncode == 0
    assert "--sparse SPARSE" in proc.stdout and "--sparse-config SPARSE_CONFIG" in proc.stdout
    assert "'off': dense" in proc.stdout
    assert "the mode is dormant" in " ".join(proc.stdout.split())  # what an unreachable min_context does


def test_samkv_mass_layers_must_be_an_increasing_fraction_range_and_map_to_layers():
    with pytest.raises(SparseConfigError, match="'mass_layer_to' of mode 'samkv' = 0.3 is out of range; allowed: greater "
                                                "than mass_layer_from = 0.4"):
        SamKVConfig(mass_layer_to=0.3)
    with pytest.raises(SparseConfigError, match="'mass_layer_from' of mode 'samkv' = 1.0 is out of range"):
        SamKVConfig(mass_layer_from=1.0)
    with pytest.raises(SparseConfigError, match="'selection' of mode 'samkv' = 'topk' is not allowed"):
        SamKVConfig(selection="topk")
    cfg = SamKVConfig()
    assert cfg.selection == "mass"
    assert list(cfg.mass_layer_range(30)) == list(range(12, 21))      # SmolLM2-135M
    assert list(cfg.mass_layer_range(32)) == list(range(12, 23))      # Llama-3.1-8B
    assert list(SamKVConfig(mass_layer_from=0.9, mass_layer_to=0.95).mass_layer_range(2)) == [1]


def test_samkv_mass_spread_is_a_token_count_of_at_least_zero():
    assert SamKVConfig().mass_spread == 8
    assert SamKVConfig(mass_spread=0).mass_spread == 0
    with pytest.raises(SparseConfigError, match="'mass_spread' of mode 'samkv' = -1 is out of range"):
        SamKVConfig(mass_spread=-1)


def test_prefill_graphs_replay_only_extend_batches_below_min_context():
    """The prefill-graph gate: a batch replays SGLang's prefill graph only when every row ends below the mode's
    min_context (stock prefill); a long row, or no host copy of the lengths, sends the batch down the eager path."""
    from types import SimpleNamespace

    import torch

    from sglang_sparse.api_hooks import prefill_graph_gate_hook

    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(sparse_prefill_graph_below=8192)))

    def batch(*lens):
        return SimpleNamespace(seq_lens_cpu=torch.tensor(lens), batch_size=len(lens))

    assert prefill_graph_gate_hook(True, runner, batch(100, 8191)) is True
    assert prefill_graph_gate_hook(True, runner, batch(100, 8192)) is False
    assert prefill_graph_gate_hook(False, runner, batch(100)) is False  # SGLang said no: stays no
    assert prefill_graph_gate_hook(True, runner, SimpleNamespace(seq_lens_cpu=None, batch_size=1)) is False
    off = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace()))
    assert prefill_graph_gate_hook(True, off, batch(100000)) is True  # modes without the gate: SGLang's answer
