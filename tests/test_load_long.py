"""Contract (CPU, real servers): ``bench.load`` runs the e2e grid (modes x input lengths x concurrencies) with
two mode servers started together and benchmarked one after another by the in-process streaming client,
and writes ``load_summary.json``, ``load_report.md`` and ``e2e_long.json`` whose per-cell ratios vs off are
finite and positive; an ``--accuracy-json`` lands beside each mode's rows; ``--rerender`` rebuilds the JSON
from the saved summary alone. No timing assertions."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from bench.load_client import cell_key, input_label
from bench.mode_settings import mode_label
from sglang_sparse.config import LastWindowConfig
from tests.serverproc import DEFAULT_MODEL, free_port, server_env

pytestmark = pytest.mark.server

LENS, CONC, OUT_LEN = (64, 128), (1, 2), 8
RATIO_KEYS = ("throughput_ratio_vs_off", "ttft_ratio_vs_off", "tpot_ratio_vs_off")


def test_labels():
    assert [input_label(n) for n in (4096, 16384, 32000, 32768, 8000, 64)] == ["4k", "16k", "32k", "32k", "8k", "64"]
    assert cell_key(32000, 8) == "32k_c8"


@pytest.fixture(scope="module")
def load_run(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("load_long")
    acc = out / "fidelity_long.json"
    acc.write_text(json.dumps({"modes": {"lastwindow": {"accuracy_ratio_by_position": {"0.5": 1.0},
                                                        "accuracy_ratio_by_length": {"64": 0.5, "128": 0.75}}}}))
    cmd = [sys.executable, "-m", "bench.load", "--device", "cpu", "--model", str(DEFAULT_MODEL),
           "--modes", "off,lastwindow", "--input-lens", ",".join(map(str, LENS)), "--output-len", str(OUT_LEN),
           "--concurrency", ",".join(map(str, CONC)), "--min-prompts", "2", "--parallel-servers", "2",
           "--port", str(free_port()),
           "--accuracy-json", str(acc), "--out", str(out / "run")]
    r = subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (out / "run" / "stdout.txt").write_text(r.stdout + r.stderr)
    return out / "run"


def test_cells_alternate_between_the_servers_of_a_group(load_run):
    """--order interleaved (the default): each cell runs on every server of the group back to back."""
    s = json.loads((load_run / "load_summary.json").read_text())
    assert s["grid"]["order"] == "interleaved"
    done = re.findall(r"\[load\] (off|lastwindow) (\S+): .* done", (load_run / "stdout.txt").read_text())
    want = [(m, cell_key(n, c)) for n in LENS for c in CONC for m in ("off", "lastwindow")]
    assert done == want


def test_summary_shapes(load_run):
    s = json.loads((load_run / "load_summary.json").read_text())
    assert s["errors"] == {}
    assert s["servers"]["groups"] == [["off", "lastwindow"]]
    assert set(s["results"]) == {"off", "lastwindow"}
    for mode, cells in s["results"].items():
        assert set(cells) == {cell_key(n, c) for n in LENS for c in CONC}
        for key, r in cells.items():
            assert r["completed"] == r["num_prompts"] >= max(2, 2 * r["concurrency"]), (mode, key, r)
            assert r["output_tokens_exact"] and r["mean_output_tokens"] == OUT_LEN
            for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms"):
                assert math.isfinite(r[k]) and r[k] > 0, (mode, key, k, r[k])
    report = (load_run / "load_report.md").read_text()
    assert "| lastwindow | 128 | 2 |" in report and "Accuracy ratio by length" in report


def test_e2e_json_and_rerender(load_run, tmp_path):
    doc = json.loads((load_run / "e2e_long.json").read_text())
    assert isinstance(doc["gpu"], str) and doc["model"] == DEFAULT_MODEL.name
    assert set(doc["modes"]) == {"off", "lastwindow"}
    for mode, row in doc["modes"].items():
        for n in LENS:
            for c in CONC:
                cell = row[cell_key(n, c)]
                for k in RATIO_KEYS:
                    assert math.isfinite(cell[k]) and cell[k] > 0, (mode, n, c, k, cell[k])
                    if mode == "off":
                        assert cell[k] == 1.0
    assert doc["modes"]["lastwindow"]["accuracy_ratio_by_length"] == {"64": 0.5, "128": 0.75}
    assert "accuracy_ratio_by_length" not in doc["modes"]["off"]
    # the config each server reported: lastwindow at its defaults, so its rows carry no settings label
    assert doc["mode_configs"]["lastwindow"]["min_context"] == LastWindowConfig().min_context
    assert mode_label(doc, "lastwindow") == "lastwindow"
    again = tmp_path / "e2e_again.json"
    r = subprocess.run([sys.executable, "-m", "bench.load", "--rerender", str(load_run), "--out", str(tmp_path / "re"),
                        "--e2e-json", str(again)], env=server_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(again.read_text()) == doc
    assert (tmp_path / "re" / "load_report.md").read_text().count("| lastwindow |") == len(LENS) * len(CONC)


def test_cells_that_overflow_a_kv_pool_get_no_ratios():
    """A cell whose concurrent requests do not fit the KV pool of the mode or of off measures queueing for
    memory: e2e_long.json keeps its figures but no ratios, and names the server."""
    from bench.load import e2e_json, pool_limited

    pools = {"off": 38468, "psa": 1053696}
    assert pool_limited(pools, ("psa", "off"), 1, 32000, 256) == []
    assert pool_limited(pools, ("psa", "off"), 8, 4096, 256) == []        # 34816 tokens fit off's pool
    assert pool_limited(pools, ("psa", "off"), 32, 4096, 256) == ["off"]
    cell = {"input_len": 4096, "concurrency": 32, "num_prompts": 64, "completed": 64, "output_throughput": 100.0,
            "mean_ttft_ms": 10.0, "median_ttft_ms": 10.0, "mean_tpot_ms": 1.0, "median_tpot_ms": 1.0}
    summary = {"meta": {"model": "m"}, "grid": {"output_len": 256, "client": "fast"},
               "servers": {"per_mode": {m: {"pool_tokens": p} for m, p in pools.items()}},
               "results": {"off": {"4k_c32": dict(cell)}, "psa": {"4k_c32": dict(cell, output_throughput=200.0)}}}
    got = e2e_json(summary)["modes"]["psa"]["4k_c32"]
    assert got["kv_pool_limited"] == ["off"] and got["throughput_ratio_vs_off"] is None
    assert got["output_throughput_tok_s"] == 200.0
    summary["servers"]["per_mode"]["off"]["pool_tokens"] = 10 ** 6
    assert e2e_json(summary)["modes"]["psa"]["4k_c32"]["throughput_ratio_vs_off"] == 2.0
