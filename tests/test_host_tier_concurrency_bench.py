"""bench/host_tier_concurrency.py (issue #6 item 6): the SLO / ratio aggregation on synthetic numbers, the
launch specs of the three servers (same pool and memory flags, only the variant's own flags differ), the
merge into host_tier.json, and the driver end to end against real CPU servers with the real SmolLM2 model
(tiny workload: two levels, short contexts)."""

from __future__ import annotations

import json
import os

import pytest

from bench import conc_report, conc_stats, prom_metrics
from bench import host_tier_concurrency as htc
from tests.serverproc import free_port


def _level(level, tpot_p50, tpot_p90, running, tok_s=100.0, failed=0, truncated=False):
    return {"level": level, "requests": 3 * level, "ok": 3 * level - failed, "failed": failed,
            "errors": ["HTTP 500"] if failed else [], "truncated": truncated, "tpot_ms_p50": tpot_p50,
            "tpot_ms_p90": tpot_p90, "sustained_running": running, "output_tok_s": tok_s}


def test_aggregate_slo_capacity_and_ratios():
    servers = {
        # SLO = 1.5 x 10 ms = 15 ms. Level 8 misses it (p90 20 ms), so dense holds 4 at the SLO.
        "dense": {"error": None, "levels": [_level(1, 10.0, 11.0, 1, 50), _level(2, 11.0, 12.0, 2, 90),
                                            _level(4, 12.0, 14.0, 4, 150), _level(8, 15.0, 20.0, 8, 200)]},
        # level 16 has a failed request and level 32 was cut short: neither counts; 8 at 14.9 ms does
        "psa_host_tier": {"error": None, "levels": [_level(1, 10.5, 11.0, 1), _level(8, 13.0, 14.9, 8, 300),
                                                    _level(16, 13.0, 14.0, 16, 600, failed=1),
                                                    _level(32, 13.0, 14.0, 32, 900, truncated=True)]},
        "hicache": {"error": "server failed to start: boom", "levels": []},
    }
    s = conc_stats.aggregate(servers, slo_factor=1.5)
    assert s["tpot_slo_ms"] == pytest.approx(15.0)
    d, p, h = (s["per_server"][k] for k in ("dense", "psa_host_tier", "hicache"))
    assert d["levels_meeting_slo"] == [1, 2, 4] and d["concurrent_at_slo"] == 4 and d["best_level"] == 4
    assert d["max_output_tok_s_at_slo"] == 150
    assert p["levels_meeting_slo"] == [1, 8] and p["concurrent_at_slo"] == 8
    assert s["concurrency_ratio_vs_dense"] == pytest.approx(2.0)
    assert s["concurrency_ratio_vs_dense_reason"] is None
    assert s["throughput_ratio_vs_dense"] == pytest.approx(300 / 150)
    assert h["concurrent_at_slo"] is None and "boom" in h["reason"]
    assert s["hicache_concurrency_ratio_vs_dense"] is None
    assert "boom" in s["hicache_concurrency_ratio_vs_dense_reason"]
    assert s["working_set_fraction"] is None and s["working_set_concurrency_bound"] is None  # none measured


def test_working_set_bound_is_one_over_the_median_measured_fraction():
    """The ceiling of the concurrency ratio for a host tier keeping only working sets on the GPU: 1 / the
    median over levels of each level's mean measured working-set fraction; levels without one are skipped."""
    lv = [_level(1, 10.0, 11.0, 1), _level(2, 10.0, 11.0, 2), _level(4, 10.0, 11.0, 4), _level(8, 10.0, 11.0, 4)]
    for r, f in zip(lv, (0.8, None, None, 0.5)):
        r["working_set_fraction_mean"] = f
    lv[2]["working_set"] = {"working_set_fraction": 0.01}  # the last decision's own fraction is not used
    s = conc_stats.aggregate({"dense": {"error": None, "levels": [_level(1, 10.0, 11.0, 1)]},
                              "psa_host_tier": {"error": None, "levels": lv}}, 1.5)
    assert s["working_set_fraction"] == pytest.approx(0.65)
    assert s["working_set_concurrency_bound"] == pytest.approx(1 / 0.65)
    assert s["per_server"]["dense"]["working_set_fraction"] is None
    assert s["working_set_concurrency_bound_by_server"] == {"psa_host_tier": pytest.approx(1 / 0.65)}


def test_level_fraction_mean_is_the_mean_over_the_levels_own_decisions():
    a = {"measured_decisions": 3, "working_set_fraction_sum": 2.4}
    b = {"measured_decisions": 7, "working_set_fraction_sum": 4.4}
    assert htc.level_fraction_mean(a, b) == pytest.approx(0.5)
    assert htc.level_fraction_mean(a, a) is None and htc.level_fraction_mean(None, b) is None


def test_aggregate_without_baseline_or_with_given_slo():
    psa = {"error": None, "levels": [_level(1, 10.0, 11.0, 1), _level(4, 12.0, 30.0, 4)]}
    # dense failed at its first level: no SLO, every ratio null with a reason, nothing crashes
    s = conc_stats.aggregate({"dense": {"error": None, "levels": [_level(1, None, None, 0, failed=3)]},
                       "psa_host_tier": psa}, 1.5)
    assert s["tpot_slo_ms"] is None and "failed" in s["tpot_slo_reason"]
    assert s["concurrency_ratio_vs_dense"] is None and s["concurrency_ratio_vs_dense_reason"]
    # dense not run at all
    s = conc_stats.aggregate({"psa_host_tier": psa}, 1.5)
    assert s["concurrency_ratio_vs_dense"] is None and "not run" in s["concurrency_ratio_vs_dense_reason"]
    # an absolute SLO: psa's level 4 (p90 30 ms) meets 40 ms
    s = conc_stats.aggregate({"psa_host_tier": psa}, 1.5, tpot_slo_ms=40.0)
    assert s["per_server"]["psa_host_tier"]["concurrent_at_slo"] == 4


def test_interval_concurrency_percentile_and_metrics_parser():
    mean, busy, peak = conc_stats.interval_concurrency([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 0.0, 10.0)
    assert peak == 2 and mean == pytest.approx(5.0 / 10.0) and busy == pytest.approx(5.0 / 4.0)
    assert conc_stats.interval_concurrency([], 0.0, 1.0) == (0.0, 0.0, 0)
    assert conc_stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert conc_stats.percentile([], 90) is None
    text = ('# HELP sglang:num_running_reqs x\nsglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0\n'
            'sglang:num_running_reqs{model_name="m",tp_rank="1"} 5.0\nsglang:num_queue_reqs{a="b"} 2.0\n'
            'sglang:num_running_reqs_other 9.0\n')
    assert prom_metrics.parse_metrics(text, prom_metrics.GAUGES) == {"sglang:num_running_reqs": 5.0, "sglang:num_queue_reqs": 2.0}


def test_server_specs_share_everything_but_the_variant_flags():
    cfg = htc.BenchConfig(device="cuda", mem_fraction_static=0.25, max_total_tokens=32768)
    specs = {n: htc.server_spec(cfg, n) for n in htc.SERVER_NAMES}
    for sp in specs.values():
        a = sp.argv()
        assert a[a.index("--mem-fraction-static") + 1] == "0.25"
        assert a[a.index("--max-total-tokens") + 1] == "32768"
        assert a[a.index("--page-size") + 1] == "16" and "--enable-metrics" in a
    assert specs["dense"].mode == "off" and "--enable-hierarchical-cache" not in specs["dense"].argv()
    assert specs["hicache"].mode == "off" and "--enable-hierarchical-cache" in specs["hicache"].argv()
    psa = json.loads(specs["psa_host_tier"].sparse_config)
    assert specs["psa_host_tier"].mode == "psa" and psa["host_tier_gb"] > 0 and psa["block_size"] == 16
    assert psa["min_context"] < cfg.first_tokens  # decode is sparse for the long contexts
    # host capacity = host_ratio x device pool: 2 x 32768 tokens x SmolLM2's 23040 bytes per token
    assert psa["host_tier_gb"] == pytest.approx(2 * 32768 * 23040 / 2**30, abs=1e-3)
    ls = json.loads(specs["loopserve_host_tier"].sparse_config)
    assert specs["loopserve_host_tier"].mode == "loopserve" and ls["host_tier_gb"] == psa["host_tier_gb"]
    assert ls["min_context"] == psa["min_context"] and ls["gpu_cache_mb"] == psa["gpu_cache_mb"]
    assert "loopserve_host_tier" not in htc.BenchConfig().servers  # on request only
    with pytest.raises(ValueError):
        htc.BenchConfig(servers=("dense", "bogus"))
    with pytest.raises(ValueError):
        htc.BenchConfig(levels=(4, 2))


def test_merge_into_keeps_existing_fields(tmp_path):
    path = tmp_path / "host_tier.json"
    path.write_text(json.dumps({"gpu": "H100", "gather_fraction_of_h2d": 0.9, "results": [1, 2],
                                "concurrency_ratio_vs_dense": None}))
    servers = {"dense": {"error": None, "levels": [_level(1, 10.0, 11.0, 2)]},
               "psa_host_tier": {"error": None, "levels": [_level(1, 10.0, 11.0, 3)]}}
    summary = conc_stats.aggregate(servers, 1.5)
    doc = conc_report.merge_into(path, summary, htc.BenchConfig(), {"command": "c", "device": "H100"})
    again = json.loads(path.read_text())
    assert again == json.loads(json.dumps(doc, default=str))
    assert again["gpu"] == "H100" and again["gather_fraction_of_h2d"] == 0.9 and again["results"] == [1, 2]
    assert again["concurrency_ratio_vs_dense"] == pytest.approx(1.5)
    assert again["concurrency"]["per_server"]["dense"]["concurrent_at_slo"] == 2


@pytest.mark.server
def test_driver_end_to_end_on_cpu_servers(tmp_path, default_model):
    """Real CPU servers, real model: two levels of two-turn conversations; every request succeeds, the
    figures are filled in, the merge keeps the transfer benchmark's fields, and the servers are gone.
    ``--sparse off`` only by default (one CPU server start is ~50-90 s); SPARSE_HTC_PSA_E2E=1 adds the
    psa + host tier server (about twice as long)."""
    servers = "dense,psa_host_tier" if os.environ.get("SPARSE_HTC_PSA_E2E") == "1" else "dense"
    merge = tmp_path / "host_tier.json"
    merge.write_text(json.dumps({"gpu": "cpu", "gather_fraction_of_h2d": 0.5, "concurrency_ratio_vs_dense": None}))
    out = tmp_path / "out"
    rc = htc.main(["--device", "cpu", "--model", str(default_model), "--servers", servers, "--levels", "1,2",
                   "--turns", "2", "--first-tokens", "200", "--turn-tokens", "40", "--output-tokens", "16",
                   "--psa-min-context", "128", "--max-total-tokens", "4096", "--port", str(free_port()),
                   "--poll-s", "0.2", "--time-budget", "400", "--out", str(out), "--merge-into", str(merge)])
    doc = json.loads((out / "host_tier_concurrency.json").read_text())
    assert rc == 0, {n: s.get("error") for n, s in doc["servers"].items()}
    for name in servers.split(","):
        srv = doc["servers"][name]
        assert srv["error"] is None and [r["level"] for r in srv["levels"]] == [1, 2]
        for r in srv["levels"]:
            assert r["failed"] == 0 and r["ok"] == 2 * r["level"] and not r["truncated"]
            assert r["output_tokens"] == 16 * r["ok"] and r["output_tok_s"] > 0
            assert r["tpot_ms_p50"] > 0 and r["ttft_ms_p50"] > 0 and r["metrics_samples"] > 0
            # the gauge is sampled every 0.2 s and SGLang refreshes it every 5 decode steps: a level may miss it
            assert r["sustained_running"] >= 1 and r["server_running_max"] is not None
            assert r["followup_cached_fraction"] is not None  # the follow-up turn reused the first turn's prefix
            if name == "dense":
                assert r["working_set"] is None  # no admission on a dense server
        assert max(r["server_running_max"] for r in srv["levels"]) >= 1  # /metrics saw a running request
        # which levels meet the SLO depends on this box's timing: check the summary against the run's own figures
        slo = doc["summary"]["tpot_slo_ms"]
        meeting = [r["level"] for r in srv["levels"] if r["tpot_ms_p90"] is not None and r["tpot_ms_p90"] <= slo]
        row = doc["summary"]["per_server"][name]
        assert row["levels_meeting_slo"] == meeting
        assert (row["concurrent_at_slo"] is None) == (not meeting) == (row["reason"] is not None)
    s = doc["summary"]
    dense_first = min(doc["servers"]["dense"]["levels"], key=lambda r: r["level"])
    assert s["tpot_slo_ms"] == pytest.approx(htc.BenchConfig().slo_factor * dense_first["tpot_ms_p50"])
    if "psa_host_tier" in servers:
        assert (s["concurrency_ratio_vs_dense"] is None) == (s["concurrency_ratio_vs_dense_reason"] is not None)
    md = (out / "host_tier_concurrency.md").read_text()
    assert "| dense | 1 |" in md and "concurrency_ratio_vs_dense" in md
    merged = json.loads(merge.read_text())
    assert merged["gather_fraction_of_h2d"] == 0.5 and "concurrency" in merged
    assert merged["concurrency_ratio_vs_dense"] == s["concurrency_ratio_vs_dense"]
    for name in servers.split(","):  # stopped by process group: the port no longer answers
        argv = doc["servers"][name]["argv"]
        port = argv[argv.index("--port") + 1]
        import requests

        with pytest.raises(requests.RequestException):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
