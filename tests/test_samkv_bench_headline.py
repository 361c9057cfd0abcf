"""bench/samkv_bench.py headline merging: another run's TTFT figures go under ``ttft_by_model``, and with
``--headline-ttft`` its ratio becomes the headline's, its set, model and weights named under
``figure_sources``; ``--merge-report`` does the same from a finished run's samkv.json."""

from __future__ import annotations

import json

from bench.samkv_bench import main


def _report(path, model, weights, ratio, words):
    src = f"TTFT set (2 tasks x 8 documents of ~{words} words)"
    details = {"model": model, "weights": weights, "gpu": "G", "ttft_ratio_vs_recompute": ratio,
               "ttft_median_s": {"samkv": ratio, "recompute": 1.0},
               "ttft_set": {"kv_kept_ratio": 0.14, "rows": [{"document_tokens": 15065}, {"document_tokens": 15180}]},
               "figure_sources": {"ttft_ratio_vs_recompute": src, "kv_kept_ratio": src}}
    path.write_text(json.dumps({"ttft_ratio_vs_recompute": ratio, "details": details}))


def test_merge_report_adds_ttft_by_model_and_with_headline_ttft_replaces_the_headline_ratio(tmp_path):
    head = tmp_path / "samkv.json"
    head.write_text(json.dumps({"model": "small", "weights": "real", "ttft_ratio_vs_recompute": 2.4,
                                "kv_kept_ratio": 0.16, "accuracy_delta_vs_recompute": 0.0,
                                "figure_sources": {"ttft_ratio_vs_recompute": "TTFT set (small)"}}))
    big = tmp_path / "big.json"
    _report(big, "8B shape", "dummy", 0.229, 1500)
    assert main(["--merge-report", str(big), "--headline", str(head)]) == 0
    h = json.loads(head.read_text())
    assert h["ttft_ratio_vs_recompute"] == 2.4 and h["ttft_by_model"]["8B shape"]["ttft_ratio_vs_recompute"] == 0.229
    assert h["ttft_by_model"]["8B shape"]["document_tokens"] == [15065, 15180]
    assert main(["--merge-report", str(big), "--headline", str(head), "--headline-ttft"]) == 0
    h = json.loads(head.read_text())
    assert h["ttft_ratio_vs_recompute"] == 0.229 and h["kv_kept_ratio"] == 0.16 and h["accuracy_delta_vs_recompute"] == 0.0
    assert h["figure_sources"]["ttft_ratio_vs_recompute"] == ("TTFT set (2 tasks x 8 documents of ~1500 words), "
                                                              "8B shape, dummy weights")
