"""Contract: bench.variants_report pairs each run's mode with that run's own ``off`` turn by turn, pairs the ``off``
records of a group's runs against each other (the noise floor), carries an ab_rounds summary through, and refuses
malformed arguments with exit 2."""

from __future__ import annotations

import json

import pytest

from bench import variants_report

POSITIONS = ("begin", "middle", "end")


def _task(i: int, pos: str, right: bool, reply: str, tokens: int = 9000, sparse: bool = True) -> dict:
    turn = {"turn": 0, "reply": reply, "token_ids": [1, 2] if right else [3], "latency_s": 0.1, "prompt_tokens": tokens,
            "completion_tokens": 3, "cached_tokens": 0, "kept_mass": None, "documents_api": False,
            "sparse": {"sparse_prefill": sparse, "sparse_decode_steps": 2 if sparse else 0},
            "em": float(right), "f1": float(right), "rouge_l": float(right), "score": float(right),
            "answers": ["x"], "position": pos, "sources": [], "metric": "em"}
    return {"task_id": f"needle_depth-{pos}-{i}", "kind": "needle_depth", "position": pos, "words": 100,
            "docs": 0, "tokens": tokens, "depth": 0.5, "turns": [turn], "error": None}


def _run(tmp_path, name: str, off_right: list[bool], mode_right: list[bool], engaged=None):
    d = tmp_path / name
    (d / "raw").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"preset": "long", "modes": ["off", "loopserve"], "errors": {},
                                            "meta": {"gpu": "G", "versions": "v", "model_name": "m",
                                                     "command": f"cmd {name}", "extra server args": "--x"}}))
    for mode, rights in (("off", off_right), ("loopserve", mode_right)):
        tasks = [_task(i, POSITIONS[i % 3], r, "yes" if r else "no",
                       sparse=mode == "loopserve" and (engaged is None or engaged[i])) for i, r in enumerate(rights)]
        (d / "raw" / f"{mode}.json").write_text(json.dumps({"server": {}, "tasks": tasks}))
    return d


def test_each_run_is_paired_with_its_own_off_and_off_records_give_the_floor(tmp_path):
    # 6 turns (2 per position): the mode misses begin turn 0 in run a; run b's off misses middle turn 1
    a = _run(tmp_path, "a", [True] * 6, [False] + [True] * 5, engaged=[False, True, True, True, True, True])
    b = _run(tmp_path, "b", [True, False] + [True] * 4, [True] * 6)
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps({"meta": {"command": "ab cmd", "gpu": "G", "input_len": 32000, "rounds": 1},
                              "summary": {"off": {"c1": {"ratio_geomean": 1.0, "median_ttft_ms": 100.0,
                                                         "median_tpot_ms": 1.5, "failed": 0}},
                                          "ls": {"c1": {"ratio_geomean": 0.5, "median_ttft_ms": 150.0,
                                                        "median_tpot_ms": 2.5, "failed": 0}}}}))
    out = tmp_path / "rep.json"
    assert variants_report.main(["--mode", "loopserve", "--fidelity", f"g:a={a}", "--fidelity", f"g:b={b}",
                                 "--floor", "g", "--ab", str(ab), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    fa, fb = rep["fidelity"]["g"]["a"], rep["fidelity"]["g"]["b"]
    assert fa["scored_turns"] == 6 and fa["accuracy_ratio_by_position"]["begin"] == pytest.approx(0.5)
    assert fa["accuracy_ratio_by_position"]["middle"] == pytest.approx(1.0)
    assert fa["output_agreement"] == pytest.approx(5 / 6)
    assert fb["accuracy_ratio_by_position"]["middle"] == pytest.approx(2.0)  # b's off missed it, its mode did not
    # run a's miss is on its one not-engaged turn: the split shows it there
    assert fa["by_engagement"]["not_engaged"] == {"turns": 1, "output_agreement": 0.0, "dense_right": 1.0,
                                                  "mode_right": 0.0}
    assert fa["by_engagement"]["engaged"]["turns"] == 5 and fa["by_engagement"]["engaged"]["output_agreement"] == 1.0
    floor = rep["off_vs_off"]["g"]["a~b"]
    assert floor["accuracy_ratio_by_position"]["middle"] == pytest.approx(0.5)
    assert floor["output_agreement"] == pytest.approx(5 / 6)
    assert rep["speed"]["servers"]["ls"]["c1"]["throughput_ratio"] == 0.5
    md = out.with_suffix(".md").read_text()
    assert "| a | 6 | 0.50 | 1.00 | 1.00 |" in md and "off a~b" in md and "| ls | 0.50 | 150.0 | 2.50 |" in md


@pytest.mark.parametrize("argv, needle", [
    (["--fidelity", "nolabel=/x"], "GROUP:LABEL=DIR"),
    (["--fidelity", "g:a=/does/not/exist"], "no run.json"),
    (["--floor", "g", "--ab", "x.json"], "--floor g"),
    ([], "nothing to report"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        variants_report.main(["--mode", "loopserve", "--out", str(tmp_path / "r.json")] + argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
