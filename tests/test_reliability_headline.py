"""Contract: ``bench.reliability`` folds a soak report and fault reports into the headline keys the reliability
issue names, counting every fault tried and listing the ones not survived, and a mode whose server did not start
is reported, not dropped."""

import json

from bench.reliability import fold, main, markdown


def _mode(failed=0, slope=1.5):
    return {"sent": 40, "completed": 38, "aborted": 2, "failed": failed, "wrong_vs_off": 0, "http_5xx": 0,
            "http_4xx": 2, "elapsed_s": 120.0, "idle_leak_check": "silent",
            "metrics": {"enabled": True, "consistent": True},
            "rss": {"samples": [{"requests": 10, "rss_mb": 900.0, "gpu_mb": 3000.0},
                                {"requests": 40, "rss_mb": 905.0, "gpu_mb": 3000.0}], "slope_mb_per_1k_requests": slope}}


def test_headline_has_the_issue_keys_per_mode_and_sums_faults(tmp_path):
    soak = {"device": "cuda", "modes": {"off": _mode(), "psa": _mode(failed=1, slope=None),
                                        "samkv": {"mode": "samkv", "error": "server exited\nOOM"}}}
    faults = [{"device": "cuda", "faults_tried": 3, "faults_survived": 3,
               "faults": [{"fault": "a", "mode": "psa", "survived": True}] * 3},
              {"device": "cuda", "faults_tried": 2, "faults_survived": 1,
               "faults": [{"fault": "b", "mode": "samkv", "survived": True},
                          {"fault": "c", "mode": "samkv", "survived": False, "outcome": "crash", "checks": {}}]}]
    soak["modes"]["off"]["facts"] = {"1": True, "2": False, "3": False}
    soak["modes"]["psa"]["facts"] = {"1": False, "2": True, "3": True}
    rep = fold(soak, faults, "GPU X")
    assert rep["soak_details"]["psa"]["right_where_off_wrong"] == 2
    assert set(rep["modes"]) == {"off", "psa"}
    assert set(rep["modes"]["psa"]) == {"sent", "completed", "aborted", "failed", "wrong_vs_off", "http_5xx",
                                       "rss_slope_mb_per_1k_requests", "idle_leak_check"}
    assert rep["modes"]["psa"]["failed"] == 1 and rep["modes"]["psa"]["rss_slope_mb_per_1k_requests"] is None
    assert rep["faults_tried"] == 5 and rep["faults_survived"] == 4
    assert [f["fault"] for f in rep["faults_not_survived"]] == ["c"]
    assert "OOM" in rep["modes_not_started"]["samkv"]
    md = markdown(rep)
    assert "4 of 5 survived" in md and "server did not start" in md and "| psa | 40 | 38 | 2 | 1 |" in md
    (tmp_path / "soak.json").write_text(json.dumps(soak))
    (tmp_path / "f.json").write_text(json.dumps(faults[0]))
    assert main(["--soak", str(tmp_path / "soak.json"), "--faults", str(tmp_path / "f.json"),
                 str(tmp_path / "missing.json"), "--gpu", "GPU X", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["faults_tried"] == 3


def test_a_repeated_off_run_is_the_noise_floor_not_a_mode():
    soak = {"device": "cuda", "modes": {"off": _mode(), "psa": _mode(), "off_repeat": _mode()}}
    soak["modes"]["off"]["facts"] = {"1": True, "2": True, "3": False}
    soak["modes"]["off_repeat"]["facts"] = {"1": False, "2": True, "3": True}
    soak["modes"]["off_repeat"]["wrong_vs_off"] = 1
    rep = fold(soak, [], "GPU X")
    assert set(rep["modes"]) == {"off", "psa"}
    assert rep["noise_floor_off_repeat"]["wrong_vs_off"] == 1
    assert rep["noise_floor_off_repeat"]["right_where_off_wrong"] == 1
    assert rep["soak_seconds_total"] == 360.0
    assert "Noise floor" in markdown(rep)


def test_a_second_soak_run_judges_its_modes_against_its_own_off(tmp_path):
    """A mode soaked under other server arguments comes from its own run, with that run's off kept beside it."""
    first = {"device": "cuda", "modes": {"off": _mode(), "psa": _mode(),
                                         "samkv": {"mode": "samkv", "error": "refused"}}}
    second = {"device": "cuda", "modes": {"off": _mode(), "samkv": _mode(slope=0.5)}}
    second["modes"]["samkv"]["wrong_vs_off"] = 3
    rep = fold([first, second], [], "GPU X", labels=["flashinfer", "triton"])
    assert set(rep["modes"]) == {"off", "psa", "samkv"}
    assert rep["modes"]["samkv"]["wrong_vs_off"] == 3 and rep["modes_not_started"] == {}
    assert rep["mode_runs"] == {"off": "flashinfer", "psa": "flashinfer", "samkv": "triton"}
    assert "off (triton)" in rep["soak_details"] and rep["soak_details"]["off"]["rss_series"] == [[10, 900.0], [40, 905.0]]
    assert rep["soak_seconds_total"] == 480.0
    assert "`samkv`: triton" in markdown(rep)
    paths = []
    for name, s in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(s))
        paths += ["--soak", f"{tmp_path / name}=triton" if name == "b.json" else str(tmp_path / name)]
    assert main(paths + ["--gpu", "G", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["mode_runs"]["samkv"] == "triton"


def test_a_later_run_replaces_the_modes_it_soaked_and_their_faults_in_a_base_headline(tmp_path):
    from bench.faults import FAULTS
    from bench.reliability import merge_into

    n_psa = sum(1 for _, applies in FAULTS.values() if "psa" in applies)
    first = {"device": "cuda", "modes": {"off": _mode(), "psa": _mode(failed=2), "samkv": _mode()}}
    base_faults = [{"device": "cuda", "faults_tried": n_psa + 2, "faults_survived": n_psa + 1,
                    "faults": [{"fault": "a", "mode": "psa", "survived": True}] * (n_psa - 1)
                    + [{"fault": "k", "mode": "psa", "survived": False, "outcome": "crash"},
                       {"fault": "b", "mode": "samkv", "survived": True},
                       {"fault": "c", "mode": "samkv", "survived": True}]}]
    base = fold(first, base_faults, "GPU X", ["first command"])
    base["notes"] = {"psa": "old reading", "samkv": "kept"}
    base["mode_configs"] = {"psa": {"min_context": 8192}, "samkv": {"block_size": 16}}  # rows under other settings
    later = {"device": "cuda", "modes": {"off": _mode(), "psa": _mode(slope=0.5)}}
    new_faults = [{"device": "cuda", "faults_tried": n_psa, "faults_survived": n_psa,
                   "faults": [{"fault": "a", "mode": "psa", "survived": True}] * n_psa}]
    rep = merge_into(base, fold(later, new_faults, "GPU X", ["later command"]), "psa run")
    assert rep["modes"]["psa"]["failed"] == 0 and rep["modes"]["psa"]["rss_slope_mb_per_1k_requests"] == 0.5
    assert rep["modes"]["samkv"] == base["modes"]["samkv"] and rep["modes"]["off"] == base["modes"]["off"]
    assert rep["mode_runs"]["psa"] == "psa run" and "off (psa run)" in rep["soak_details"]
    assert rep["faults_tried"] == n_psa + 2 and rep["faults_survived"] == n_psa + 2
    assert rep["faults_not_survived"] == []
    assert rep["notes"] == {"samkv": "kept"} and rep["commands"] == ["first command", "later command"]
    assert rep["mode_configs"] == {"samkv": {"block_size": 16}}  # the replaced row's settings go with it
    md = markdown(rep)
    assert "| samkv (block_size 16) |" in md and "| psa |" in md
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "soak.json").write_text(json.dumps(later))
    (tmp_path / "f.json").write_text(json.dumps(new_faults[0]))
    assert main(["--soak", f"{tmp_path / 'soak.json'}=psa run", "--faults", str(tmp_path / "f.json"), "--gpu", "GPU X",
                 "--base", str(tmp_path / "base.json"), "--out", str(tmp_path / "r.json"),
                 "--md", str(tmp_path / "r.md")]) == 0
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["faults_tried"] == n_psa + 2 and got["mode_runs"]["psa"] == "psa run"
    assert f"{n_psa + 2} of {n_psa + 2} survived" in (tmp_path / "r.md").read_text()


def test_a_merge_of_rows_from_another_gpu_names_each_gpu_with_its_rows():
    from bench.reliability import merge_into

    base = fold({"device": "cuda", "modes": {"off": _mode(), "psa": _mode(), "samkv": _mode()}}, [], "GPU X")
    rep = merge_into(base, fold({"device": "cuda", "modes": {"off": _mode(), "psa": _mode()}}, [], "GPU Y"), "run 2")
    assert rep["gpu_by_mode"] == {"off": "GPU X", "psa": "GPU Y", "samkv": "GPU X"}  # the base's off row is kept
    assert rep["gpu"] == "GPU X (off, samkv); GPU Y (psa)"
    again = merge_into(rep, fold({"device": "cuda", "modes": {"off": _mode(), "samkv": _mode()}}, [], "GPU Y"), "run 3")
    assert again["gpu"] == "GPU X (off); GPU Y (psa, samkv)"
    same = merge_into(base, fold({"device": "cuda", "modes": {"off": _mode(), "psa": _mode()}}, [], "GPU X"), "run 2")
    assert same["gpu"] == "GPU X" and "GPU X" in markdown(same)
