"""Contract: docs/results.md is generated from the headline JSONs (every figure read, a missing file named as
missing, never filled in)."""

from __future__ import annotations

import json

from bench import results_doc


def test_results_doc_reads_the_headline_jsons_and_names_missing_ones(tmp_path):
    fid = {"gpu": "G", "model": "M", "preset": "long", "dense_floor": 0.3,
           "dense_accuracy_by_position": {"begin": 0.25, "middle": 0.5, "end": 0.75},
           "dense_accuracy_by_length": {"8k": 0.6, "16k": 0.5, "32k": 0.4},
           "modes": {"psa": {"accuracy_ratio_by_position": {"begin": 0.912, "middle": 1.0, "end": 0.5},
                             "accuracy_ratio_by_length": {"8k": 1.0, "16k": 0.875, "32k": None},
                             "paired_ci95_by_position": {"begin": [-4.25, 1.0], "middle": None, "end": [0.0, 0.0]},
                             "dense_at_length": ["32k"], "engaged_fraction": 0.625, "output_agreement": 0.875}}}
    (tmp_path / "fidelity_long.json").write_text(json.dumps(fid))
    text = results_doc.build(tmp_path)
    assert "| psa | 0.91 | 1.00 | 0.50 | 1.00 | 0.88 | dense | [-4.2, +1.0] / n/a / [+0.0, +0.0] | 0.62 | 0.88 |" in text
    assert "0.25 (!)" in text  # dense below the floor is marked
    assert "(missing: run `python -m bench.load` on the testbed)" in text


def test_rows_measured_under_other_settings_name_them(tmp_path):
    """A headline's ``mode_configs`` (rows measured with other than the mode's defaults) labels that mode's rows in
    every section; the other modes' rows stay unlabelled."""
    fid = {"gpu": "G", "model": "M", "preset": "long", "mode_configs": {"lastwindow": {"min_context": 4096}},
           "modes": {m: {"accuracy_ratio_by_position": {"begin": 0.5}, "accuracy_ratio_by_length": {}}
                     for m in ("psa", "lastwindow")}}
    e2e = {"gpu": "G", "mode_configs": {"lastwindow": {"min_context": 4096}},
           "modes": {m: {"4k_c1": {"throughput_ratio_vs_off": 0.5, "ttft_ratio_vs_off": 1.0, "tpot_ratio_vs_off": 1.0,
                                   "output_throughput_tok_s": 10.0}} for m in ("psa", "lastwindow")}}
    rel = {"gpu": "G", "faults_tried": 1, "faults_survived": 1, "mode_configs": {"psa": {"min_context": 8192}},
           "modes": {m: {"sent": 1, "completed": 1, "aborted": 0, "failed": 0, "wrong_vs_off": 0, "http_5xx": 0,
                         "rss_slope_mb_per_1k_requests": 0.0, "idle_leak_check": "silent"} for m in ("psa", "samkv")}}
    for name, doc in (("fidelity_long.json", fid), ("e2e_long.json", e2e), ("reliability.json", rel)):
        (tmp_path / name).write_text(json.dumps(doc))
    text = results_doc.build(tmp_path)
    assert "| lastwindow (min_context 4096) | 0.50 |" in text and "| psa | 0.50 |" in text
    assert "| lastwindow (min_context 4096) | 4k_c1 | 0.50 |" in text and "| psa | 4k_c1 | 0.50 |" in text
    assert "| psa (min_context 8192) | 1 | 1 |" in text and "| samkv | 1 | 1 |" in text


def test_samkv_plain_load_at_defaults_gets_its_own_table(tmp_path):
    """``samkv_plain_load.json`` (samkv at its defaults on plain requests against its own off) is rendered as its own
    table, unlabelled when it names no other settings; a missing file is named as missing."""
    assert "(missing: run `TESTBED_MODES=off,samkv scripts/gpu/testbed.sh e2e`)" in results_doc.build(tmp_path)
    plain = {"gpu": "H", "model": "M", "modes": {
        "off": {"4k_c1": {"throughput_ratio_vs_off": 1.0}},
        "samkv": {"4k_c1": {"throughput_ratio_vs_off": 0.876, "ttft_ratio_vs_off": 0.96, "tpot_ratio_vs_off": 1.15,
                            "output_throughput_tok_s": 608.8}}}}
    (tmp_path / "samkv_plain_load.json").write_text(json.dumps(plain))
    text = results_doc.build(tmp_path)
    section = text.split("### samkv at its defaults, plain requests")[1].split("\n## ")[0]
    assert "GPU: H; model: M" in section
    assert "| samkv | 4k_c1 | 0.88 | 0.96 | 1.15 | 609 |" in section
    assert "| off |" not in section


def test_decode_only_ceiling_is_the_stock_cells_wall_over_their_prefills_alone(tmp_path):
    """Per stock cell: wall = prompts x output_len / tok/s, prefills = prompts x the concurrency-1 TTFT of the same
    input; cells with no concurrency-1 cell of their input length are left out, and no e2e JSON means no section."""
    def cell(inp, conc, n, tps, ttft):
        return {"input_len": inp, "concurrency": conc, "num_prompts": n, "output_throughput_tok_s": tps,
                "mean_ttft_ms": ttft}

    e2e = {"gpu": "G", "output_len": 100,
           "modes": {"off": {"32k_c1": cell(32000, 1, 2, 100.0, 500.0), "32k_c8": cell(32000, 8, 16, 400.0, 900.0),
                             "16k_c8": cell(16000, 8, 16, 800.0, 300.0)}}}
    (tmp_path / "e2e_long.json").write_text(json.dumps(e2e))
    text = results_doc.build(tmp_path)
    # c1: wall 2 x 100 / 100 = 2 s, prefills 2 x 0.5 = 1 s; c8: wall 16 x 100 / 400 = 4 s, prefills 16 x 0.5 = 8 s
    assert "| 32k_c1 | 2.00 | 1.00 | 50 % | 2.00 |" in text
    assert "| 32k_c8 | 4.00 | 8.00 | 100 % | 1.00 |" in text
    assert "16k_c8" not in text.split("What a decode-only mode")[1]
    assert "What a decode-only mode" not in results_doc.build(tmp_path / "missing")
