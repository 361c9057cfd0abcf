"""Contract: a bad --sparse / --sparse-config ends start-up with exit 2 and a short message that names the
field, what it must be (type and range, integers printed as integers) and what it got; per-request knobs
name the type they got; duplicate keys are refused; argparse errors print one usage line, not SGLang's
whole usage."""

from __future__ import annotations

import pytest

from sglang_sparse.modes import load_config_arg
from sglang_sparse.config import LastWindowConfig, LoopServeConfig, PsaConfig, SparseConfigError
from sglang_sparse.request_params import RequestParamsError, normalize_request_options
from tests.serverproc import DEFAULT_MODEL


@pytest.fixture(scope="module")
def prepare():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.server_args as sa

    return sa.prepare_server_args


def _fail(prepare, capsys, *argv) -> list[str]:
    with pytest.raises(SystemExit) as exc:
        prepare(["--model-path", str(DEFAULT_MODEL), "--device", "cpu", *argv])
    assert exc.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_lastwindow_even_pool_kernel_exits_2_with_one_line_naming_field_and_range(prepare, capsys):
    lines = _fail(prepare, capsys, "--sparse", "lastwindow", "--sparse-config", '{"pool_kernel": 4}')
    assert lines == ["sglang: error: --sparse-config: field 'pool_kernel' of mode 'lastwindow' = 4 is not allowed; "
                     "allowed: an odd integer in [1, 63]"]
    with pytest.raises(SparseConfigError):
        LastWindowConfig.from_dict({"pool_kernel": 4})


@pytest.mark.parametrize("argv,error", [
    (["--sparse", "bogus"], "argument --sparse: unknown --sparse mode 'bogus'"),
    (["--sparse-config", "{not json"], "argument --sparse-config: --sparse-config is not valid JSON"),
    (["--sparse-config", "@/nonexistent/sparse.json"], "'/nonexistent/sparse.json' cannot be read"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
], ids=["mode", "json", "file", "flag"])
def test_argparse_errors_print_a_short_usage_and_the_error(prepare, capsys, argv, error):
    lines = _fail(prepare, capsys, *argv)
    assert len(lines) == 2, lines
    assert lines[0].startswith("usage: ") and lines[0].endswith("(see --help)")
    assert error in lines[1] and lines[1].startswith(lines[0].split()[1])


@pytest.mark.parametrize("text", ['{"epsilon": 0.9, "epsilon": 0.5}', '{"a": {"b": 1, "b": 2}}'])
def test_duplicate_keys_in_sparse_config_are_refused_naming_the_key(prepare, capsys, tmp_path, text):
    key = "epsilon" if "epsilon" in text else "b"
    with pytest.raises(SparseConfigError, match=f"key '{key}' appears more than once"):
        load_config_arg(text)
    lines = _fail(prepare, capsys, "--sparse", "psa", "--sparse-config", text)
    assert f"key '{key}' appears more than once" in lines[-1]
    path = tmp_path / "dup.json"
    path.write_text(text)
    lines = _fail(prepare, capsys, "--sparse", "psa", "--sparse-config", f"@{path}")
    assert f"file '{path}': key '{key}' appears more than once" in lines[-1]
    assert load_config_arg('{"epsilon": 0.9, "min_request_epsilon": 0.5}') == {"epsilon": 0.9,
                                                                               "min_request_epsilon": 0.5}


def test_engine_style_config_string_with_duplicate_keys_is_refused(prepare):
    from sglang_sparse.server_args import SparseServerArgs

    with pytest.raises(SparseConfigError, match="key 'epsilon' appears more than once"):
        SparseServerArgs(model_path=str(DEFAULT_MODEL), device="cpu", sparse="psa",
                         sparse_config='{"epsilon": 0.9, "epsilon": 0.5}')


@pytest.mark.parametrize("cls,raw,message", [
    (PsaConfig, {"epsilon": "0.9"}, "'epsilon' of mode 'psa' = \"0.9\" must be a number in (0, 1], got string"),
    (PsaConfig, {"epsilon": None}, "'epsilon' of mode 'psa' = null must be a number in (0, 1], got null"),
    (PsaConfig, {"epsilon": True}, "'epsilon' of mode 'psa' = true must be a number in (0, 1], got boolean"),
    (LoopServeConfig, {"budget": "512"}, "'budget' of mode 'loopserve' = \"512\" must be an integer in "
                                         "[1, 16777216], got string"),
    (LoopServeConfig, {"budget": 0}, "'budget' of mode 'loopserve' = 0 is out of range; allowed range [1, 16777216]"),
], ids=["eps-str", "eps-null", "eps-bool", "budget-str", "budget-0"])
def test_config_wrong_type_names_the_type_and_ranges_print_integers(cls, raw, message):
    with pytest.raises(SparseConfigError) as exc:
        cls.from_dict(raw)
    assert message in str(exc.value)
    assert "e+" not in str(exc.value)


@pytest.mark.parametrize("mode,cfg,raw,message", [
    ("psa", PsaConfig(), {"epsilon": "0.9"}, "epsilon = '0.9' must be a number in (0, 1], got string"),
    ("psa", PsaConfig(), {"epsilon": None}, "epsilon = None must be a number in (0, 1], got null"),
    ("psa", PsaConfig(), {"epsilon": True}, "epsilon = True must be a number in (0, 1], got boolean"),
    ("psa", PsaConfig(), {"epsilon": 0}, "epsilon = 0 is out of range: expected a number in (0, 1]"),
    ("loopserve", LoopServeConfig(), {"budget": "512"},
     "budget = '512' must be an integer in [1, 16777216], got string"),
    ("loopserve", LoopServeConfig(), {"budget": 1.5},
     "budget = 1.5 is not an integer: expected an integer in [1, 16777216]"),
    ("loopserve", LoopServeConfig(), {"budget": 0}, "budget = 0 is out of range: expected an integer in [1, 16777216]"),
], ids=["eps-str", "eps-null", "eps-bool", "eps-0", "budget-str", "budget-frac", "budget-0"])
def test_request_knob_wrong_type_is_not_called_out_of_range(mode, cfg, raw, message):
    with pytest.raises(RequestParamsError) as exc:
        normalize_request_options(mode, cfg, {"sparse": raw})
    assert f"custom_params.sparse.{message}" in str(exc.value)
    assert "e+" not in str(exc.value)


def test_launch_server_process_exits_2_with_one_error_line_for_an_even_pool_kernel():
    """The real entry point, in its own process: exit 2 before the model loads, no traceback."""
    import subprocess
    import sys

    from tests.serverproc import server_env

    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(DEFAULT_MODEL),
                           "--device", "cpu", "--sparse", "lastwindow", "--sparse-config", '{"pool_kernel": 4}'],
                          capture_output=True, text=True, timeout=300, env=server_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines()
            if line.strip() and "warn" not in line.lower() and not line.startswith("  Example:")]
    assert ours == ["sglang: error: --sparse-config: field 'pool_kernel' of mode 'lastwindow' = 4 is not allowed; "
                    "allowed: an odd integer in [1, 63]"], proc.stderr[-3000:]


def test_launch_server_process_exits_2_with_one_error_line_for_a_host_tier_below_one_block():
    """``host_tier_gb`` 1e-6 is inside the key's range but holds no KV block: the real entry point exits 2 with
    one line naming the field and the smallest useful value (it used to fail in the scheduler with a traceback)."""
    import subprocess
    import sys

    from tests.serverproc import server_env

    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(DEFAULT_MODEL),
                           "--device", "cpu", "--sparse", "psa", "--sparse-config", '{"host_tier_gb": 1e-6}'],
                          capture_output=True, text=True, timeout=300, env=server_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("sglang: error: --sparse-config: field 'host_tier_gb'"), \
        proc.stderr[-3000:]
    assert "the smallest useful value is 2.15e-05" in errors[0]
