"""Unit tests of the bench harness pieces that need no server: corpus, task generator,
scorers, fidelity maths, report aggregation."""

from __future__ import annotations

import math

import pytest

from bench import corpus, report, scoring, tasks


def test_corpus_is_offline_real_prose():
    paras = corpus.paragraphs()
    assert len(paras) >= 200
    assert all(p.endswith(".") and len(p.split()) >= 30 for p in paras)
    assert not any(ch.isdigit() for p in paras for ch in p), "digits must be stripped so planted numbers are unique"
    assert "pydoc_data" in corpus.source_description()


def test_generator_is_deterministic_and_seeded():
    a = tasks.generate("cpu", seed=0)
    b = tasks.generate("cpu", seed=0)
    c = tasks.generate("cpu", seed=1)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert [t.to_json() for t in a] != [t.to_json() for t in c]


@pytest.mark.parametrize("position", tasks.POSITIONS)
def test_question_position_and_trailer(position):
    t = tasks.make_task("needle", position, 200, 3)
    user = t.turns[0].user
    q = user.index("Question:")
    assert user.endswith(tasks.TRAILER)
    frac = q / len(user)
    if position == "begin":
        assert q == 0
    elif position == "end":
        assert user[q:].count("\n\n") == 1  # only the trailer follows
    else:
        assert 0.2 < frac < 0.8


def test_headline_preset_extends_the_full_presets_headline_tasks():
    """The larger headline preset keeps every full-preset headline task (same ids, same text) and only
    headline-eligible tasks, with twice as many per question position."""
    def headline(name):
        p = tasks.PRESETS[name]
        return {t.task_id: t for t in tasks.generate(name)
                if t.kind in p.accuracy_kinds and t.words <= tasks.HEADLINE_MAX_WORDS}

    full, big = headline("full"), headline("headline")
    assert len(big) == len(tasks.generate("headline")) == 2 * len(full)
    assert all(big[k] == t for k, t in full.items())
    for pos in tasks.POSITIONS:
        assert sum(t.position == pos for t in big.values()) == 140


def test_answers_live_in_the_source_turns():
    for kind in ("needle", "recall", "recall2"):
        for pos in tasks.POSITIONS:
            t = tasks.make_task(kind, pos, 80, 5)
            for turn in t.turns:
                for ans, src in zip(turn.answers, turn.sources):
                    assert f"secret number is {ans}." in t.turns[src].user
            last = t.turns[-1]
            if kind != "needle":
                # the last turn's answer comes only from earlier turns
                assert all(s < len(t.turns) - 1 for s in last.sources)
                assert not any(f"is {a}." in last.user for a in last.answers)
    t = tasks.make_task("recall2", "middle", 80, 1)
    assert len(t.turns[-1].answers) == 2 and t.turns[-1].metric == "f1"


@pytest.mark.parametrize("kind,need", [("multidoc", 1), ("multidoc2", 2)])
def test_multidoc(kind, need):
    t = tasks.make_task(kind, "middle", 50, 2, docs=4)
    user = t.turns[0].user
    assert all(f"Document {i}:" in user for i in range(1, 5))
    assert len(t.meta["needed_docs"]) == need == len(t.turns[0].answers)
    docs = user.split("Document ")
    for d, ans in zip(t.meta["needed_docs"], t.turns[0].answers):
        assert any(part.startswith(f"{d}:") and f"is {ans}." in part for part in docs)
    with pytest.raises(ValueError, match="docs"):
        tasks.make_task(kind, "end", 50, 0, docs=1)


def test_long_haystack_beyond_corpus_size():
    t = tasks.make_task("needle", "end", 30000, 0)  # > corpus size: reshuffled reuse
    assert len(t.turns[0].user.split()) > 30000


def test_scorers():
    assert scoring.exact_match("The answer is 2622.", ("2622",)) == 1.0
    assert scoring.exact_match("26220", ("2622",)) == 0.0
    assert scoring.f1("4370 and 3092", ("4370", "3092")) == 1.0
    assert scoring.f1("4370", ("4370", "3092")) == pytest.approx(2 / 3)
    assert scoring.rouge_l("w b c d", "b c x d") == pytest.approx(0.75)
    assert scoring.task_scores("x 1", ("1",), "em")["score"] == 1.0
    with pytest.raises(ValueError):
        scoring.task_scores("x", ("1",), "bleu")


def test_greedy_agreement():
    assert scoring.greedy_agreement([1, 2, 3], [1, 2, 3])["exact"] == 1.0
    g = scoring.greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4])
    assert g["prefix"] == 0.5 and g["positional"] == 0.75 and g["exact"] == 0.0
    assert scoring.greedy_agreement([1, 2], [1, 2, 3])["prefix"] == pytest.approx(2 / 3)
    assert scoring.greedy_agreement(list(range(200)), list(range(128)) + [0] * 72)["exact"] == 1.0


def test_kl_top1():
    e = [[-0.1, 5, None], [-2.5, 6, None]]
    same = scoring.kl_top1([None, e], [None, e])
    assert same["positions"] == 1 and same["kl"] == 0.0 and same["top1"] == 1.0
    diff = scoring.kl_top1([e], [[[-0.5, 6, None], [-1.0, 5, None]]])
    assert diff["top1"] == 0.0 and diff["kl"] > 0.1
    assert math.isnan(scoring.kl_top1([], [])["kl"])


def _fake_rec(scores):
    return {"tasks": [{"task_id": f"needle-{p}-{i}", "kind": "needle", "position": p, "words": 100, "docs": 0,
                       "turns": [{"turn": 0, "reply": "", "token_ids": [1, 2], "latency_s": 0.1, "prompt_tokens": 10,
                                  "completion_tokens": 2, "cached_tokens": 0, "kept_mass": km, "em": s, "f1": s,
                                  "rouge_l": s, "score": s, "answers": ["1"], "position": p, "sources": [0],
                                  "metric": "em"}], "error": None}
                      for p, ss, km in scores for i, s in enumerate(ss)], "fidelity": []}


def test_report_headline_and_fidelity(tmp_path):
    preset = tasks.PRESETS["tiny"]
    dense = _fake_rec([("begin", [1, 0], None), ("middle", [1, 1], None), ("end", [1, 1], None)])
    sparse = _fake_rec([("begin", [0, 0], 0.9), ("middle", [1, 1], 0.95), ("end", [1, 1], 1.0)])
    h = report.headline(dense, preset)
    assert h["tasks"] == 6 and h["accuracy_by_position"] == {"begin": 0.5, "middle": 1.0, "end": 1.0}
    f = report.fidelity(dense, sparse)
    assert f["reply_exact"] == 1.0 and f["kept_mass"] == pytest.approx(0.95)
    assert math.isnan(report.kept(dense))
    meta = {"gpu": "none", "model_name": "m", "dtype": "bfloat16"}
    path = report.write_report(tmp_path, {"off": dense, "x": sparse}, preset, meta, {"y": "boom"})
    text = path.read_text()
    assert "| off | 6 | 0.50 | 1.00 | 1.00 |" in text and "boom" in text and "n/a" in text
    assert (tmp_path / "accuracy_by_position.png").stat().st_size > 1000
    import json
    b = json.loads((tmp_path / "baseline_dense.json").read_text())
    assert b == {"gpu": "none", "model": "m", "dtype": "bfloat16", "tasks": 6,
                 "accuracy_by_position": {"begin": 0.5, "middle": 1.0, "end": 1.0}}


def test_psa_fidelity_figures_are_ratios_computed_from_the_run():
    import json
    from pathlib import Path

    from bench.psa_fidelity import fidelity_figures

    summary = json.loads((Path(__file__).parents[1] / "tests/data/runs/cpu_tiny_off_vs_psa/summary.json").read_text())
    figs = fidelity_figures(summary)
    dense = summary["modes"]["off"]["headline"]["accuracy_by_position"]
    sparse = summary["modes"]["psa"]["headline"]["accuracy_by_position"]
    for pos in ("begin", "middle", "end"):
        assert figs["accuracy_ratio_by_position"][pos] == sparse[pos] / dense[pos]
    assert figs["output_agreement"] == summary["modes"]["psa"]["fidelity"]["reply_exact"]
    assert figs["gpu"] == summary["meta"]["gpu"]


def test_kept_mass_reads_the_chat_summary_and_the_generate_step_rows():
    from bench.client import kept_mass

    assert kept_mass({"sparse": {"kept_mass": 0.97}}) == 0.97
    rows = [[0, 0, 0, 0, 0, 0.95], [1, 3, 10, 1.9, 2, 0.95], [1, 3, 10, 1.7, 2, 0.95]]
    assert abs(kept_mass({"sparse_psa_steps": rows}) - 0.9) < 1e-9
    assert kept_mass({}) is None and kept_mass(None) is None


def test_a_terminated_driver_stops_the_servers_it_started(tmp_path):
    """bench.server: a driver killed with SIGTERM (``timeout``) still stops its servers' process groups."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time
    from pathlib import Path

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import atexit, subprocess, sys, time
        from bench.server import Server, _exit_on_sigterm
        srv = Server.__new__(Server)
        srv.spec = type("S", (), {"mode": "dummy"})()
        srv.log = lambda *a: None
        srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        atexit.register(srv.stop)
        _exit_on_sigterm()
        print(srv.proc.pid, flush=True)
        time.sleep(600)
    """))
    root = str(Path(__file__).resolve().parent.parent)
    drv = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                           env={**os.environ, "PYTHONPATH": root})
    child = int(drv.stdout.readline())
    drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while time.time() < deadline:
        if not alive(child):
            break
        time.sleep(0.2)
    else:
        os.killpg(child, signal.SIGKILL)
        raise AssertionError("the driver's server outlived it")


def test_wave_plan_pick_keeps_every_swept_case_within_3_percent_of_the_default_and_real_reads_unchanged():
    from bench.psa_plans import pick_wave_plan

    def row(b, p, g, w, pf, t, case="planted", frac=0.01):
        return dict(case=case, batch=b, ctx=131072 if case == "planted" else 32000, programs_per_sm=p, wave_growth=g,
                    max_waves=w, sorted_prefix_blocks=pf, t_psa_us=t, read_frac=frac)

    rows = [row(8, 4, 2.0, 12, 1024, 260.0), row(1, 4, 2.0, 12, 1024, 100.0),
            row(8, 8, 4.0, 5, 1024, 200.0), row(1, 8, 4.0, 5, 1024, 110.0),   # faster headline, b1 10 % slower
            row(8, 4, 4.0, 5, 1024, 220.0), row(1, 4, 4.0, 5, 1024, 101.0),   # within 3 % everywhere
            row(8, 4, 4.0, 5, 256, 210.0), row(1, 4, 4.0, 5, 256, 100.0),     # faster still ...
            dict(case="planted", batch=8, ctx=131072, programs_per_sm=2, wave_growth=2.0, max_waves=5, error="x")]
    base = (4, 2.0, 12, 1024)  # the plan the rows are judged against
    assert pick_wave_plan(rows, base) == dict(programs_per_sm=4, wave_growth=4.0, max_waves=5, sorted_prefix_blocks=256)
    real = [row(0, 4, 2.0, 12, 1024, 50.0, "testbed real", 0.90), row(0, 4, 4.0, 5, 1024, 50.0, "testbed real", 0.90),
            row(0, 4, 4.0, 5, 256, 50.0, "testbed real", 0.93), row(0, 8, 4.0, 5, 1024, 50.0, "testbed real", 0.9)]
    # ... but it reads more blocks of the real capture: the plan that keeps the default prefix wins
    assert pick_wave_plan(rows + real, base) == dict(programs_per_sm=4, wave_growth=4.0, max_waves=5, sorted_prefix_blocks=1024)
    assert pick_wave_plan(rows[:2], base) == dict(programs_per_sm=4, wave_growth=2.0, max_waves=12, sorted_prefix_blocks=1024)
    assert pick_wave_plan([]) is None


def test_pick_crit_takes_the_fastest_headline_not_slower_elsewhere():
    """pick_crit: the fastest batch 8 / 128k layer among (layout, launch shape) pairs no more than 3 % slower than the
    base on any case; failed rows never win."""
    from bench.psa_plans import pick_crit
    from flashinfer_ext.psa.criticality import CritTile

    def row(b, layout, tile, t, case="planted"):
        return dict(case=case, batch=b, ctx=131072 if case == "planted" else 32000, meta_layout=layout,
                    crit_tile=dict(tile_b=tile.tile_b, heads=tile.heads, elements=tile.elements,
                                   num_warps=tile.num_warps), t_psa_us=t)

    base, t32, allh = CritTile(), CritTile(tile_b=32, num_warps=4), CritTile(heads=0)
    rows = [row(8, "planar", base, 360.0), row(1, "planar", base, 120.0),
            row(8, "interleaved", allh, 280.0), row(1, "interleaved", allh, 130.0),  # fastest headline, b1 8 % slower
            row(8, "planar", t32, 330.0), row(1, "planar", t32, 121.0),            # within 3 % everywhere
            dict(row(8, "interleaved", t32, 1.0), error="x")]
    want = dict(meta_layout="planar", crit_tile=dict(tile_b=32, heads=1, elements=8192, num_warps=4))
    assert pick_crit(rows, ("planar", base)) == want
    real = [row(0, "planar", base, 240.0, "testbed real"), row(0, "planar", t32, 260.0, "testbed real")]
    assert pick_crit(rows + real, ("planar", base)) == dict(meta_layout="planar", crit_tile=dict(
        tile_b=0, heads=1, elements=8192, num_warps=0))
    assert pick_crit([]) is None


def test_loopserve_turns_configs_parse_labels_modes_and_json():
    from bench.loopserve_turns import parse_configs

    got = parse_configs('off, loopserve,eng=loopserve:{"min_context": 4096, "alpha": 0.99},lw=lastwindow')
    assert got == [("off", "off", None), ("loopserve", "loopserve", None),
                   ("eng", "loopserve", '{"min_context": 4096, "alpha": 0.99}'), ("lw", "lastwindow", None)]
    with pytest.raises(ValueError, match="not JSON"):
        parse_configs("x=loopserve:{bad")
    with pytest.raises(ValueError, match="duplicate"):
        parse_configs("off,off")
    with pytest.raises(ValueError, match="names no mode"):
        parse_configs("x=")


def test_host_profile_reduces_folded_stacks_to_self_inclusive_and_idle_shares():
    from bench.host_profile import reduce_folded

    lines = ["MainThread (1);run_scheduler_process (s.py:1);event_loop (sglang/srt/managers/scheduler.py:10);run_batch (x.py:3);"
             "begin_batch (sglang_sparse/psa/runner.py:5) 30",
             "MainThread (1);run_scheduler_process (s.py:1);event_loop (sglang/srt/managers/scheduler.py:10);"
             "poll (zmq/sugar.py:2) 60",
             "MainThread (1);run_scheduler_process (s.py:1);event_loop (sglang/srt/managers/scheduler.py:10);"
             "run_batch (x.py:3) 10",
             "Watchdog (2);watchdog_once (w.py:1);wait (threading.py:1) 500",
             "garbage line", ""]
    r = reduce_folded(lines, top=5)
    assert r["samples"] == 100 and r["idle_share"] == 0.6
    assert r["self"][0] == {"frame": "poll (zmq/sugar.py:2)", "share": 0.6}
    incl = {x["frame"]: x["share"] for x in r["inclusive"]}
    assert incl["begin_batch (sglang_sparse/psa/runner.py:5)"] == 0.3
    assert "run_batch (x.py:3)" not in incl and len(incl) == 1
    assert {x["frame"]: x["share"] for x in r["scheduler"]}["event_loop (sglang/srt/managers/scheduler.py:10)"] == 1.0
    assert reduce_folded([])["samples"] == 0


@pytest.mark.parametrize("args,msg", [(["--sparse-config", "psa"], "MODE=JSON"), (["--concurrency", "1,x"], "integers"),
                                      (["--concurrency", "0"], ">= 1"), (["--prompts", "0"], "--prompts must be >= 1")])
def test_host_profile_refuses_bad_arguments(tmp_path, capsys, args, msg):
    from bench.host_profile import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_ab_rounds_ratios_are_per_round_against_the_baseline_servers_mean(tmp_path):
    from bench import ab_rounds

    def cell(tput, tpot=1.5):
        return {"output_throughput": tput, "median_tpot_ms": tpot, "median_ttft_ms": 20.0, "failed": 0}

    raw = {"off": {"c1": [cell(100), cell(120)]}, "off2": {"c1": [cell(110), cell(100)]},
           "psa": {"c1": [cell(95), cell(99)]}}
    s = ab_rounds.summarize(raw, ["off", "off2"])
    assert s["psa"]["c1"]["ratio_per_round"] == [round(95 / 105, 4), round(99 / 110, 4)]
    assert s["psa"]["c1"]["ratio_geomean"] == round(math.sqrt(95 / 105 * 99 / 110), 4)
    assert s["psa"]["c1"]["ratio_min"] == round(99 / 110, 4) and s["off"]["c1"]["ratio_max"] == round(120 / 110, 4)
    assert ab_rounds.rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and ab_rounds.rotated([], 3) == []
    report = {"meta": {"rounds": 2, "gpu": "g", "command": "c", "baseline": ["off", "off2"],
                       "servers": [{"label": k, "mode": "off", "config": None} for k in raw]}, "summary": s}
    md = ab_rounds.render_md(report)
    assert "| psa | 0.9" in md and "mean of off, off2" in md and "over the run" not in md
    report["sparse_stats"] = {"psa": {"sparse_rows": 12, "switched_dense_rows": 500, "probe_read_fraction": 0.91234,
                                      "unlisted": 3}, "off": None}
    md = ab_rounds.render_md(report)
    assert "sparse_rows 12, switched_dense_rows 500, probe_read_fraction 0.912" in md and "unlisted" not in md
    assert "dormant" not in md
    report["sparse_engagement"] = {"off2": {"min_context": 32768, "longest_sequence": 32767, "dormant": True}}
    md = ab_rounds.render_md(report)
    assert "`off2`: `--sparse off`; dormant (min_context 32768 above the longest sequence 32767" in md


def test_ab_rounds_refuses_bad_server_lists_and_paths(tmp_path, capsys):
    from bench import ab_rounds

    base = ["--model", "m", "--out", str(tmp_path)]
    for argv, msg in ((["--servers", "off,off"], "--servers: duplicate labels"),
                      (["--servers", "off,psa", "--pythonpath", "x=/"], "no server is labelled 'x'"),
                      (["--servers", "off,psa", "--pythonpath", f"psa={tmp_path}/missing"], "expected LABEL=DIR (an existing folder)"),
                      (["--servers", "off", "--rounds", "0"], "--rounds must be >= 1"),
                      (["--servers", 'psa:{"epsilon": ', "--rounds", "1"], "not JSON")):
        with pytest.raises(SystemExit):
            ab_rounds.parse_args(base + argv)
        assert msg in capsys.readouterr().err
    a = ab_rounds.parse_args(base + ["--servers", "off,psa", "--pythonpath", f"psa={tmp_path}"])
    assert a.paths == {"psa": str(tmp_path.resolve())}
    spec = ab_rounds._spec(a, 1, "psa", "psa", None)
    assert spec.port == 31001 and spec.env["PYTHONPATH"].startswith(str(tmp_path.resolve()))
    assert "--max-total-tokens" in spec.extra_args and ab_rounds._spec(a, 0, "off", "off", None).env == {}
