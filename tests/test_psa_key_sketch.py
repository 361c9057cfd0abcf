"""Contract: ``bench.psa_key_sketch`` quantizes keys within half a quantization step, its sketch-driven selection
reads the sink and local blocks first, stops as soon as every query head's kept share (exact mass read against the
sketch's unread mass) passes epsilon, keeps that share in truth on a planted case, and at epsilon 1 reads every block
and reproduces dense attention."""

from __future__ import annotations

import pytest
import torch

from bench.psa_key_sketch import simulate_pair, sketch_keys


@pytest.mark.parametrize("kind,qmax", [("int4", 7.0), ("int8", 127.0)])
def test_integer_sketch_is_within_half_a_step(kind, qmax):
    k = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * 4
    step = k.abs().amax(-1, keepdim=True) / qmax
    assert bool(((sketch_keys(k, kind) - k).abs() <= step * 0.5 + 1e-2 * step).all())


def test_fp8_sketch_is_close_and_bad_kinds_are_refused():
    k = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(2))
    assert float((sketch_keys(k, "fp8") - k).abs().max()) < 0.1 * float(k.abs().max())
    with pytest.raises(ValueError, match="sketch kind"):
        sketch_keys(k, "int2")


def _planted(L=16 * 40, d=64, g=3, hot_block=17):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(g, d, generator=gen)
    k = torch.randn(L, d, generator=gen) * 0.1
    k[hot_block * 16:(hot_block + 1) * 16] += q.mean(0) * 4.0   # one block holding ~all of every head's mass
    v = torch.randn(L, d, generator=gen)
    return q, k, v


def test_a_planted_block_is_read_early_and_the_kept_share_holds():
    q, k, v = _planted()
    r = simulate_pair(q, k, v, sketch_keys(k[:, None], "int4")[:, 0], sm=0.125, block=16, eps=0.9, slack=1.0)
    assert r["read"] == 4                      # sink + 2 local blocks, then the planted block: enough
    assert r["kept_min"] >= 0.9


def test_epsilon_one_reads_every_block_and_equals_dense():
    q, k, v = _planted()
    r = simulate_pair(q, k, v, sketch_keys(k[:, None], "int8")[:, 0], sm=0.125, block=16, eps=1.0, slack=0.0)
    assert r["read"] == r["blocks"]
    assert r["kept_min"] == pytest.approx(1.0)
    assert r["out_err"] < 1e-5


def test_merged_report_holds_the_rows_and_the_greedy_answers(tmp_path):
    import json

    from bench.psa_key_sketch import main

    row = {"prompt_len": 30402, "depth": 0.5, "sketch": "int4", "eps": 0.95, "slack": 2.0, "read_frac": 0.207,
           "kept_true_min": 0.9854, "pairs_out_err_gt_0.1": 0, "pairs": 90, "max_out_err": 0.047,
           "bytes_vs_dense": 0.34}
    e2e = {"prompt_len": 16169, "depth": 0.9, "seed": 1, "sketch": "int4", "eps": 0.95, "slack": 2.0,
           "read_frac": 0.3, "same": True, "dense_correct": True, "sketched_correct": True}
    src = tmp_path / "a.json"
    src.write_text(json.dumps({"rows": [row], "e2e": [e2e]}))
    assert main(["--merge", str(src), "--out", str(tmp_path / "m.json"), "--md", str(tmp_path / "m.md")]) == 0
    md = (tmp_path / "m.md").read_text()
    assert "| 30402 | 50% | int4 | 0.95 | 2 | 0.207 | 0.9854 | 0 / 90 | 0.047 | 0.340 |" in md
    assert "| 16169 | 90% | 1 | int4 | 0.95 | 2 | 0.300 | yes | yes | yes |" in md
    assert json.loads((tmp_path / "m.json").read_text())["rows"] == [row]


@pytest.mark.parametrize("case", ["16000:1", "16k:1:0.9", "16000:1:0.9:2"])
def test_a_malformed_e2e_case_is_refused_naming_the_format(tmp_path, case, capsys):
    from bench.psa_key_sketch import main

    with pytest.raises(SystemExit) as e:
        main(["--e2e", case, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "TOKENS:SEED:DEPTH" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["begin:8", "first:8:1", "begin:x:1"])
def test_a_malformed_rag_case_is_refused_naming_the_format(tmp_path, case, capsys):
    from bench.psa_key_sketch import main

    with pytest.raises(SystemExit) as e:
        main(["--e2e-rag", case, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "POSITION:DOCS:SEED" in capsys.readouterr().err
