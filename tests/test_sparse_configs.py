"""Contract: the bench drivers' ``--sparse-config MODE=JSON`` items are parsed by one function that refuses, naming
the item, what a server would refuse later (or silently ignore): no ``=``, ``off`` or an unknown mode, a mode given
twice, a mode the driver does not run, and a config its mode rejects. Good items come back as given."""

from __future__ import annotations

import json

import pytest

from bench.sparse_configs import parse_mode_configs


def test_good_items_come_back_as_given(tmp_path):
    f = tmp_path / "ls.json"
    f.write_text(json.dumps({"min_context": 4096}))
    got = parse_mode_configs(['psa={"epsilon": 0.9}', f"loopserve=@{f}", "samkv="])
    assert got == {"psa": '{"epsilon": 0.9}', "loopserve": f"@{f}", "samkv": ""}
    assert parse_mode_configs([]) == {}


@pytest.mark.parametrize("items,modes,msg", [
    (["psa"], None, "expected MODE=JSON"),
    (['={"epsilon": 0.9}'], None, "expected MODE=JSON"),
    (['off={}'], None, "'off' is not a sparse mode with a config"),
    (['dense={}'], None, "'dense' is not a sparse mode with a config"),
    (['psa={"epsilon": 0.9}', 'psa={"epsilon": 0.8}'], None, "mode 'psa' is given twice"),
    (['loopserve={}'], ["off", "psa"], "mode 'loopserve' is not among the modes run (off, psa)"),
    (['psa={"epsilon": 2}'], None, "field 'epsilon' of mode 'psa' = 2.0 is out of range"),
    (['psa={"epsilonn": 0.9}'], None, "epsilonn"),
    (['psa={not json'], None, "is not valid JSON"),
    (['psa=@/nonexistent/x.json'], None, "cannot be read"),
    (['samkv={"min_middle_blocks": -1}'], None, "field 'min_middle_blocks' of mode 'samkv'"),
])
def test_bad_items_are_refused_naming_the_item(items, modes, msg):
    with pytest.raises(ValueError, match="--sparse-config") as e:
        parse_mode_configs(items, modes)
    assert msg in str(e.value)


@pytest.mark.parametrize("driver", ["bench.load", "bench.decode_profile", "bench.run_harness", "bench.host_profile",
                                    "bench.soak"])
def test_every_driver_refuses_a_bad_item_before_starting_anything(driver, tmp_path, capsys):
    import importlib

    mod = importlib.import_module(driver)
    args = {"bench.load": ["--device", "cpu", "--model", "m", "--modes", "psa"],
            "bench.decode_profile": ["--device", "cpu", "--out", str(tmp_path)],
            "bench.run_harness": ["--device", "cpu", "--model", "m"],
            "bench.host_profile": ["--model", "m", "--out", str(tmp_path)],
            "bench.soak": ["--launch", "off,psa", "--model", "m"]}[driver]
    with pytest.raises(SystemExit) as e:
        mod.main(args + ["--sparse-config", 'psa={"epsilon": 2}'])
    assert e.value.code == 2
    assert "field 'epsilon' of mode 'psa' = 2.0 is out of range" in capsys.readouterr().err


def test_psa_select_schedule_needs_the_sketch_estimator():
    from sglang_sparse.config import PsaConfig, SparseConfigError

    cfg = PsaConfig.from_dict({"estimator": "sketch", "schedule": "select"})
    assert (cfg.estimator, cfg.schedule) == ("sketch", "select")
    with pytest.raises(SparseConfigError, match=r"field 'schedule' of mode 'psa' = \"select\" is not allowed"):
        PsaConfig.from_dict({"schedule": "select"})
    with pytest.raises(SparseConfigError, match="schedule"):
        PsaConfig.from_dict({"estimator": "sketch", "schedule": "waves"})


def test_psa_calib_slack_reaches_the_kernel_config():
    from sglang_sparse.config import PsaConfig
    from sglang_sparse.psa.runner import kernel_config

    assert kernel_config(PsaConfig()).calib_slack == 2.0
    cfg = kernel_config(PsaConfig.from_dict({"estimator": "sketch", "schedule": "select", "calib_slack": 4}))
    assert (cfg.calib_slack, cfg.schedule, cfg.estimator) == (4.0, "select", "sketch")


def test_psa_stock_rows_auto_is_exact_only_under_deterministic_inference():
    from types import SimpleNamespace

    from sglang_sparse.config import PsaConfig, SparseConfigError
    from sglang_sparse.psa.backend import exact_stock_rows

    def runner(det):
        return SimpleNamespace(server_args=SimpleNamespace(enable_deterministic_inference=det))

    auto = PsaConfig()
    assert auto.stock_rows == "auto"
    assert exact_stock_rows(auto, runner(True)) and not exact_stock_rows(auto, runner(False))
    assert exact_stock_rows(PsaConfig.from_dict({"stock_rows": "exact"}), runner(False))
    assert not exact_stock_rows(PsaConfig.from_dict({"stock_rows": "kernel"}), runner(True))
    with pytest.raises(SparseConfigError, match="stock_rows"):
        PsaConfig.from_dict({"stock_rows": "dense"})
