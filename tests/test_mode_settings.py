"""Contract: a headline row is labelled with the settings it ran under that differ from the mode's current defaults
(``bench.mode_settings``), so a row measured at an old default stays labelled after the default moves; the settings
come from what each server reported, and travel with the rows through the soak fold and the e2e merge."""

from __future__ import annotations

import dataclasses

from bench.e2e_merge import merge
from bench.mode_settings import mode_label, reported_config, settings_diff
from bench.reliability import fold, markdown
from sglang_sparse.config import LastWindowConfig, PsaConfig


def test_rows_at_todays_defaults_keep_the_bare_name():
    full = dataclasses.asdict(LastWindowConfig())
    assert settings_diff("lastwindow", full) == {}
    assert mode_label({"mode_configs": {"lastwindow": full}}, "lastwindow") == "lastwindow"
    assert mode_label({}, "psa") == "psa"


def test_rows_at_other_settings_name_only_what_differs():
    old = {**dataclasses.asdict(LastWindowConfig()), "min_context": 4096}
    assert settings_diff("lastwindow", old) == {"min_context": 4096}
    assert mode_label({"mode_configs": {"lastwindow": old}}, "lastwindow") == "lastwindow (min_context 4096)"
    assert mode_label({"mode_configs": {"psa": {"min_context": PsaConfig().min_context, "epsilon": 0.5}}},
                      "psa") == "psa (epsilon 0.5)"


def test_the_config_is_read_from_server_info():
    info = {"internal_states": [{"sparse": {"mode": "psa", "config": {"min_context": 8192}}}]}
    assert reported_config(info) == {"min_context": 8192}
    assert reported_config({"internal_states": [{}]}) is None and reported_config(None) is None


def _soak_row(**extra):
    return {"sent": 4, "completed": 4, "aborted": 0, "failed": 0, "wrong_vs_off": 0, "http_5xx": 0,
            "rss": {"samples": [], "slope_mb_per_1k_requests": 0.0}, "idle_leak_check": "silent", **extra}


def test_the_soak_fold_keeps_each_servers_config_and_labels_its_row():
    soak = {"device": "cuda", "modes": {"off": _soak_row(), "psa": _soak_row(sparse_config={"min_context": 8192}),
                                        "samkv": _soak_row(sparse_config={"block_size": 32})}}
    rep = fold(soak, [], "GPU X")
    assert rep["mode_configs"] == {"psa": {"min_context": 8192}, "samkv": {"block_size": 32}}
    md = markdown(rep)
    assert "| psa (min_context 8192) | 4 |" in md and "| samkv | 4 |" in md  # samkv's block_size is its default


def test_a_mode_merged_from_another_invocation_brings_its_settings():
    base = {"gpu": "G", "modes": {"off": {}, "lastwindow": {}}, "mode_configs": {"lastwindow": {"min_context": 4096}}}
    add = {"gpu": "G", "modes": {"off": {}, "lastwindow": {"4k_c1": {}}}, "mode_configs": {"lastwindow": {"budget": 8}}}
    assert merge(base, [(add, ["lastwindow"], "B")], "A")["mode_configs"] == {"lastwindow": {"budget": 8}}
    bare = {"gpu": "G", "modes": {"off": {}, "lastwindow": {"4k_c1": {}}}}
    assert merge(base, [(bare, ["lastwindow"], "B")], "A")["mode_configs"] == {}
