"""The kernel benches' ``real_*`` headline entries (issues 23 and 24): attention captured from the 32k testbed
model on its own needle prompt, not planted structure.

On the CPU the ``--real-only`` paths run end to end at tiny prompt sizes (Triton interpreter, no FlashInfer:
times are not measured, so ``speedup_vs_dense`` is null) and must MERGE into the headline JSON already in
``--out``: the planted rows and summary keys stay, the ``real_*`` keys and ``testbed real`` rows are added.
Also: the true covered mass of a LoopServe selection matches the loopserve reference, and the merge replaces
rerun slots instead of duplicating them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import real_capture

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def testbed_model(default_model, tmp_path_factory):
    """The repo's 32k testbed folder, or one built from the default model (the builder only writes config)."""
    if (real_capture.TESTBED_MODEL / "config.json").is_file():
        return real_capture.TESTBED_MODEL
    out = tmp_path_factory.mktemp("testbed") / "SmolLM2-135M-Instruct-32k"
    proc = subprocess.run([sys.executable, "-m", "sglang_sparse.tools.build_model", "--context", "32768",
                           "--base", str(default_model), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def _real_only(script: str, out: Path, model: Path, *extra: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the --real-only path; a GPU runs it at full size (scripts/gpu/testbed.sh realkern)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--real-only", "--testbed-model", str(model),
                        "--out", str(out), *extra], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def _seeded(tmp_path: Path, name: str) -> dict:
    """The committed headline without its testbed real rows (the planted rows a --real-only run merges into)."""
    d = json.loads((RESULTS / name).read_text())
    d = {k: v for k, v in d.items() if not k.startswith("real_")}
    d["results"] = [r for r in d["results"] if r.get("case") != "testbed real"]
    d["meta"] = {k: v for k, v in d["meta"].items() if k != "real_run"}
    (tmp_path / name).write_text(json.dumps(d))
    return d


def test_psa_real_only_run_merges_real_32k_into_the_existing_headline(tmp_path, testbed_model):
    old = _seeded(tmp_path, "psa_decode.json")
    assert "real_32k" not in old
    _real_only("psa_decode_bench.py", tmp_path, testbed_model, "--real-tokens", "384,768", "--real-layers", "3,21",
               "--real-estimators", "sketch,calibrated")
    new = json.loads((tmp_path / "psa_decode.json").read_text())
    for key, val in old.items():  # planted summary keys and rows kept as they were
        if key not in ("meta", "results"):
            assert new[key] == val, key
    assert new["results"][:len(old["results"])] == old["results"]
    real = new["results"][len(old["results"]):]
    assert [(r["slot"], r["estimator"]) for r in real] == [("real_16k", "sketch"), ("real_16k", "calibrated"),
                                                           ("real_32k", "sketch"), ("real_32k", "calibrated")]
    assert all(r["case"] == "testbed real" and "error" not in r for r in real), real
    assert all(r["batch"] == 2 * 3 and r["heads"] == "9/3" and r["layers"] == [3, 21] for r in real)
    assert all(r["rope_type"] == "yarn" and r["rope_attention_scaling"] > 1 for r in real)  # the testbed's YaRN
    assert real[0]["ctx"] < real[2]["ctx"] and real[2]["ctx"] == real[2]["prompt_len"] > 768
    # the default estimator's rows are real_16k / real_32k, the sketch's real_16k_sketch / real_32k_sketch
    assert [new[k]["estimator"] for k in ("real_16k", "real_32k", "real_16k_sketch", "real_32k_sketch")] == \
        ["calibrated", "calibrated", "sketch", "sketch"]
    for slot in ("real_16k", "real_32k", "real_16k_sketch", "real_32k_sketch"):
        e = new[slot]
        assert {"read_fraction", "speedup_vs_dense", "bytes_ratio_topk_over_psa"} <= set(e)
        assert 0 < e["read_fraction"] <= 1
        assert math.isfinite(e["bytes_ratio_topk_over_psa"]) and e["bytes_ratio_topk_over_psa"] > 0
        assert e["speedup_vs_dense"] is None  # no FlashInfer timing on a CPU: null, not a made-up number
        assert 0 < e["kept_mean"] <= 1 + 1e-6 and e["kept_mean"] >= e["eps"] - 0.05
    assert new["meta"]["real_run"]["real_layers"] == [3, 21]
    assert new["meta"]["command"] == old["meta"]["command"]
    assert "testbed real" in (tmp_path / "psa_decode.md").read_text()


def test_loopserve_real_only_run_merges_real_32k_into_the_existing_headline(tmp_path, testbed_model):
    old = _seeded(tmp_path, "loopserve_prefill.json")
    assert "real_32k" not in old
    _real_only("loopserve_prefill_bench.py", tmp_path, testbed_model, "--real-tokens", "512",
               "--real-layers", "3,27", "--real-eval-rows", "64")
    new = json.loads((tmp_path / "loopserve_prefill.json").read_text())
    for key, val in old.items():
        if key not in ("meta", "results"):
            assert new[key] == val, key
    assert new["results"][:len(old["results"])] == old["results"]
    real = new["results"][len(old["results"]):]
    assert [(r["case"], r["slot"], r["layer"]) for r in real] == [("testbed real", "real_32k", 3),
                                                                 ("testbed real", "real_32k", 27)], real
    e = new["real_32k"]
    assert {"line_fraction", "speedup_vs_dense", "covered_mass", "area_fraction", "tile_fraction",
            "slash_blocks_crossed"} <= set(e)
    assert 0 < e["line_fraction"] < 1
    assert 0 < e["area_fraction"] <= 1 and 0 < e["slash_blocks_crossed"] <= e["tile_fraction"]
    assert 0 < e["covered_mass"] <= 1 + 1e-6
    # alpha-coverage of the sampled rows should carry over to unsampled rows of real attention, roughly
    assert e["covered_mass"] > 0.8, e
    assert e["speedup_vs_dense"] is None
    assert [p["layer"] for p in e["per_layer"]] == [3, 27] and e["ctx"] > 512
    assert all(r["covered_eval_rows"] == 64 and r["out_err_mean"] < 0.1 for r in real)
    assert "Testbed real attention" in (tmp_path / "loopserve_prefill.md").read_text()


def test_covered_mass_matches_the_loopserve_reference():
    from flashinfer_ext.loopserve.reference import covered_mass_reference
    from flashinfer_ext.loopserve.vs_select import VSSelection

    g = torch.Generator().manual_seed(0)
    T, hq, hk, d = 96, 6, 2, 16
    q, k = torch.randn(T, hq, d, generator=g), torch.randn(T, hk, d, generator=g)
    k[:4] += 2.0  # some heavy columns
    sel_v = torch.rand(hk, T, generator=g) < 0.2
    sel_s = torch.rand(hk, T, generator=g) < 0.2

    def compact(m):
        idx = torch.full((hk, T), -1, dtype=torch.int32)
        for h in range(hk):
            nz = m[h].nonzero().flatten()
            idx[h, :nz.numel()] = nz.to(torch.int32)
        return idx, m.sum(1, dtype=torch.int32)

    v_idx, v_cnt = compact(sel_v)
    s_idx, s_cnt = compact(sel_s)
    sel = VSSelection(v_idx, v_cnt, s_idx, s_cnt, torch.ones(hk))
    rows = torch.tensor([0, 5, 31, 47, 80, 95])
    got = real_capture.covered_mass(q, k, sel, rows, d ** -0.5, chunk=4)
    want = covered_mass_reference(q[rows], rows, k, torch.arange(T), T, d ** -0.5, v_idx, v_cnt, s_idx, s_cnt)
    assert torch.allclose(got, want.float(), atol=1e-5), (got, want)
    full = real_capture.covered_mass(q, k, VSSelection(*compact(torch.ones(hk, T, dtype=torch.bool)),
                                                       *compact(torch.zeros(hk, T, dtype=torch.bool)),
                                                       torch.ones(hk)), rows, d ** -0.5)
    assert torch.allclose(full, torch.ones(hk))  # every vertical selected: all mass covered


def test_merge_replaces_a_rerun_slot_and_estimator_instead_of_duplicating_it(tmp_path):
    path = tmp_path / "h.json"
    assert real_capture.merge_real_rows(path, [{"case": "testbed real", "slot": "real_32k"}], {"real_32k": {}},
                                        {"command": "x"}) == (None, {"command": "x"},
                                                             [{"case": "testbed real", "slot": "real_32k"}])
    path.write_text(json.dumps({"gpu": "H100", "speedup_128k": 21.0, "real_32k": {"line_fraction": 0.5},
                                "meta": {"command": "full"},
                                "results": [{"case": "planted", "ctx": 4096},
                                            {"case": "testbed real", "slot": "real_32k", "layer": 3, "v": 1},
                                            {"case": "testbed real", "slot": "real_16k", "v": 1}]}))
    top, meta, rows = real_capture.merge_real_rows(
        path, [{"case": "testbed real", "slot": "real_32k", "layer": 3, "v": 2}],
        {"real_32k": {"line_fraction": 0.25}}, {"command": "real", "gpu": "H200"})
    assert top == {"gpu": "H100", "speedup_128k": 21.0, "real_32k": {"line_fraction": 0.25}}
    assert meta == {"command": "full", "real_run": {"command": "real", "gpu": "H200"}}
    assert rows == [{"case": "planted", "ctx": 4096}, {"case": "testbed real", "slot": "real_16k", "v": 1},
                    {"case": "testbed real", "slot": "real_32k", "layer": 3, "v": 2}]
    # a rerun of one estimator keeps the other estimators' rows of the same slot
    path.write_text(json.dumps({"meta": {}, "results": [
        {"case": "testbed real", "slot": "real_32k", "estimator": "calibrated", "v": 1},
        {"case": "testbed real", "slot": "real_32k", "estimator": "select", "v": 1}]}))
    _, _, rows = real_capture.merge_real_rows(
        path, [{"case": "testbed real", "slot": "real_32k", "estimator": "select", "v": 2}], {}, {})
    assert rows == [{"case": "testbed real", "slot": "real_32k", "estimator": "calibrated", "v": 1},
                    {"case": "testbed real", "slot": "real_32k", "estimator": "select", "v": 2}]


def test_capture_attention_is_hf_attention_without_a_mask_tensor(testbed_model):
    """The capture's attention (:func:`bench.psa_capture._causal_sdpa`: K/V heads repeated, ``is_causal``, the
    form that keeps fp32 SDPA off CUDA's math backend at 32k) gives the q/k/v of HF's own "sdpa" path, and
    no mask tensor reaches it."""
    from bench.psa_capture import CAPTURE_ATTN, capture_qkv, load_model

    tok, ours = load_model(testbed_model)
    _, ref = load_model(testbed_model, attn="sdpa")
    assert ours.config._attn_implementation == CAPTURE_ATTN
    masks = []
    ours.model.layers[2].self_attn.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    ids = real_capture.testbed_ids(tok, 256)
    a, b = capture_qkv(ids=ids, layers=(2, 9), model=ours), capture_qkv(ids=ids, layers=(2, 9), model=ref)
    assert masks == [None]
    for layer in (2, 9):
        assert a[layer][0].shape == (ids.numel(), 9, 64) and a[layer][1].shape == (ids.numel(), 3, 64)
        for x, y in zip(a[layer], b[layer]):
            assert torch.allclose(x, y, atol=1e-4, rtol=1e-4), float((x - y).abs().max())
