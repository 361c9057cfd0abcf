"""Contract: the soak driver (``python -m bench.soak``) talks to 127.0.0.1 only, stays within its request
bound, plans the same items in every mode, and on a real CPU server it launched itself reports no failed
request, no 5xx, the planted facts checked, RSS samples with a slope, ``/metrics`` consistent with the
requests sent, a silent idle memory check, and leaves no server process behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import soak
from bench.soak_observe import last_half_slope, metrics_report, process_tree, slope_per_1k
from sglang_sparse.config import LoopServeConfig, PsaConfig
from sglang_sparse.request_params import normalize_request_options


@pytest.mark.parametrize("url", ["http://10.0.0.1:30000", "http://localhost.example:80", "https://127.0.0.1:1"])
def test_soak_refuses_any_server_but_local_http(url, capsys):
    with pytest.raises(ValueError, match="only talks to http://127.0.0.1"):
        soak.SoakConfig(url=url)
    with pytest.raises(SystemExit) as exc:
        soak.main(["--url", url])
    assert exc.value.code == 2 and "only talks to http://127.0.0.1" in capsys.readouterr().err


def test_soak_config_names_the_bad_field():
    with pytest.raises(ValueError, match="requests = 0 must be an integer >= 1"):
        soak.SoakConfig(requests=0)
    with pytest.raises(ValueError, match="time_budget_s = -1 must be a number > 0"):
        soak.SoakConfig(time_budget_s=-1)


def test_workload_is_the_same_in_every_run_and_mixes_every_kind():
    a, b = soak.Workload(soak.SoakConfig(seed=3)), soak.Workload(soak.SoakConfig(seed=3))
    items = [a.item(i) for i in range(200)]
    assert items == [b.item(i) for i in range(200)]
    assert {it["kind"] for it in items[:5]} == set(soak.KINDS)
    rag = [it for it in items if it["kind"] == "rag"]
    assert len({it["salt"] for it in rag}) == 3
    for it in items:
        if it["kind"] == "rag":
            assert any(it["answer"] in d for d in it["documents"])
        elif it["kind"] != "bad":
            assert it["answer"] in it["context"]


def test_knob_options_pass_the_servers_validation_unclamped():
    for u in (0.0, 0.37, 1.0):
        for mode, cfg in (("psa", PsaConfig()), ("loopserve", LoopServeConfig())):
            opts = soak.knob_options(mode, u)
            assert normalize_request_options(mode, cfg, {"sparse": opts}) == opts
    assert soak.knob_options("off", 0.5) is None and soak.knob_options("samkv", 0.5) is None


def test_slope_and_metrics_and_reference_comparison():
    assert slope_per_1k([(0, 100.0), (100, 101.0), (200, 102.0)]) == 10.0
    assert slope_per_1k([(5, 1.0)]) is None
    samples = [{"requests": r, "rss_mb": 100.0 + (r > 50) * 0.5 * (r - 50)} for r in range(0, 101, 10)]
    assert last_half_slope(samples) == 500.0  # flat first half ignored
    counts = {"sent": 10, "completed": 8, "http_4xx": 1, "aborted": 1}
    m = {"sglang:num_requests_total": 0.0, "sglang:num_aborted_requests_total": 0.0,
         "sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0}
    assert metrics_report(m, {**m, "sglang:num_requests_total": 9.0}, counts, "off")["consistent"]
    assert not metrics_report(m, {**m, "sglang:num_requests_total": 7.0}, counts, "off")["consistent"]
    assert not metrics_report(m, {**m, "sglang:num_requests_total": 12.0}, counts, "off")["consistent"]
    assert metrics_report(m, {**m, "sglang:num_requests_total": 12.0}, counts, "samkv")["consistent"]
    assert metrics_report(None, m, counts, "off") == {"enabled": False}
    # what is checked, by name; the abort counter is reported, not checked (client-aborted streams never reach it)
    rep = metrics_report(m, {**m, "sglang:num_requests_total": 9.0}, counts, "samkv")
    assert rep["checks"] == {"finished_covers_completed": True, "finished_within_admitted": None,
                             "idle_after_run": True}
    assert rep["aborted_counter"] == 0.0 and rep["client_aborts"] == 1 and rep["consistent"]
    busy = {**m, "sglang:num_requests_total": 9.0, "sglang:num_running_reqs": 1.0}
    assert not metrics_report(m, busy, counts, "off")["checks"]["idle_after_run"]
    assert soak.wrong_vs({"facts": {"1": True, "2": False, "3": True}}, {"1": False, "2": False, "3": True}) == 1
    assert soak.wrong_vs(None, {"1": False}) is None


def test_short_soak_on_launched_cpu_servers_off_then_samkv(default_model, tmp_path):
    out = tmp_path / "soak.json"
    # 120-word documents are below samkv's default min_document_tokens, and their kept budget holds no middle block
    # (min_middle_blocks): 0 for both makes them go through the assembly
    rc = soak.main(["--launch", "samkv,off", "--model", str(default_model), "--requests", "16", "--concurrency", "2",
                    "--sparse-config", 'samkv={"min_document_tokens": 0, "min_middle_blocks": 0}',
                    "--turn-words", "120", "--max-tokens", "8", "--sample-every", "4", "--time-budget", "900",
                    "--log-dir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["off", "samkv"]  # off first: the reference of the others
    for mode, r in report["modes"].items():
        _check_short_run(mode, r, tmp_path)
    assert report["modes"]["off"]["documents_requests_served"] == 0
    assert report["modes"]["samkv"]["documents_requests_served"] >= 1  # rag items went through the documents API
    # ... and samkv assembled their documents (a fallback-only run would be a dense soak in samkv's name)
    assert report["modes"]["samkv"]["documents_requests_fallback"] < report["modes"]["samkv"]["documents_requests_served"]
    assert report["modes"]["samkv"]["documents_requests_assembled"] >= 1
    assert report["modes"]["samkv"]["sparse_config"]["min_document_tokens"] == 0
    assert report["modes"]["off"]["documents_requests_fallback"] == 0
    # the fallbacks, if any, are counted by the reason the responses gave
    sam = report["modes"]["samkv"]
    assert sum(sam["documents_fallback_reasons"].values()) == sam["documents_requests_fallback"]
    assert report["modes"]["off"]["documents_fallback_reasons"] == {}
    assert report["modes"]["samkv"]["wrong_vs_off"] is not None


def _check_short_run(mode: str, r: dict, tmp_path: Path) -> None:
    assert "error" not in r, r.get("error")
    assert r["mode"] == mode and all(n > 0 for n in r["items_by_kind"].values()), r["items_by_kind"]
    assert r["sent"] == 16, r  # the request bound holds exactly
    assert r["failed"] == 0 and r["http_5xx"] == 0, r["errors"]
    assert r["completed"] + r["aborted"] + r["rejected_as_expected"] == r["sent"]
    assert r["facts_checked"] >= 1 and (mode != "off" or r["wrong_vs_off"] == 0)
    assert len(r["rss"]["samples"]) >= 3 and all(s["rss_mb"] > 0 for s in r["rss"]["samples"])
    assert r["rss"]["slope_mb_per_1k_requests"] is not None
    assert r["metrics"]["enabled"] and r["metrics"]["consistent"], r["metrics"]
    assert r["idle_leak_check"] == "silent"
    pid = r["config"]["server_pid"]
    assert pid and not process_tree(pid) and not Path(f"/proc/{pid}").exists()  # stopped by its group
    assert os.path.getsize(tmp_path / f"soak_server_{mode}.log") > 0
