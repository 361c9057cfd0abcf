"""Contract: the fault driver (``python -m bench.faults``, issue #27 item 2) names every fault it injects, its
edge configs and per-request limits agree with the configs' own validation, and a short subset run against one
real CPU ``psa`` server (knobs at their limits, client aborts during prefill and decode, then the KV pool under
pressure) ends with every fault survived: clear 400s or served, the server alive and answering, SGLang's idle
memory check silent, the planted-fact probe answered as before the faults, and no server left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import faults
from sglang_sparse.config import SparseConfigError
from sglang_sparse.modes import MODES
from sglang_sparse.request_params import RequestParamsError, normalize_request_options


def test_registry_names_every_fault_of_the_issue():
    assert set(faults.FAULTS) == {"kv_pressure", "doc_evicted", "line_store_full", "host_tier_full", "abort_prefill",
                                  "abort_assembly", "abort_decode", "knobs_at_limits", "config_range_edges"}
    for name, (fn, modes) in faults.FAULTS.items():
        assert callable(fn) and modes and set(modes) <= set(faults.MODES), name


@pytest.mark.parametrize("mode", ["psa", "loopserve"])
def test_knob_cases_are_at_and_just_beyond_the_servers_limits(mode):
    cls = MODES[mode].config_cls
    cfg = cls.from_dict(faults.SERVERS[mode][1])
    ok, bad = faults._knob_cases(mode)
    assert ok and bad
    for opts in ok:
        normalize_request_options(mode, cfg, {"sparse": opts})  # served (maybe clamped)
    for opts in bad:
        with pytest.raises(RequestParamsError, match=f"custom_params.sparse.{next(iter(opts))}"):
            normalize_request_options(mode, cfg, {"sparse": opts})


@pytest.mark.parametrize("mode", sorted(faults.EDGES))
def test_edge_configs_are_valid_and_one_step_beyond_is_refused(mode):
    cls = MODES[mode].config_cls
    good, beyond = faults.EDGES[mode]
    cls.from_dict(good)
    for cfg in beyond:
        with pytest.raises(SparseConfigError, match=next(iter(cfg))):
            cls.from_dict(cfg)


def test_short_fault_run_on_one_cpu_psa_server(default_model, tmp_path):
    out = tmp_path / "faults.json"
    rc = faults.main(["--faults", "knobs_at_limits,abort_prefill,abort_decode,kv_pressure", "--modes", "psa",
                      "--model", str(default_model), "--request-timeout", "300", "--log-dir", str(tmp_path),
                      "--out", str(out)])
    report = json.loads(out.read_text())
    assert [(f["fault"], f["mode"]) for f in report["faults"]] == [
        ("knobs_at_limits", "psa"), ("abort_prefill", "psa"), ("abort_decode", "psa"), ("kv_pressure", "psa")]
    for f in report["faults"]:
        assert f["survived"], json.dumps(f)[:3000]
        assert f["checks"]["idle_leak_check"] == "silent" and f["checks"]["probe_same_as_before"]
    assert rc == 0 and report["faults_tried"] == report["faults_survived"] == 4
    knobs = report["faults"][0]
    assert knobs["outcome"] == "error"
    assert all(c["http"] == c["expected"] for c in knobs["details"]["cases"])
    assert any(c["http"] == 400 and "custom_params.sparse.epsilon" in c["message"]
               for c in knobs["details"]["cases"])
    assert all(h == 200 for h in report["faults"][3]["details"]["http"])
    assert report["server_pids"] and not any(Path(f"/proc/{p}").exists() for p in report["server_pids"])
