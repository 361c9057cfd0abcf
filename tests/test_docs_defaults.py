"""Contract: each default is declared once, in the mode's config class (sglang_sparse/config.py); the knob tables
of docs/<mode>.md repeat it for readers and must agree with it, key by key (no table row without a config field,
no stale default)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sglang_sparse.config import LastWindowConfig, LoopServeConfig, PsaConfig, SamKVConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
ROW = re.compile(r"^\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)*) \| ([^|]+) \|")
HOST_TIER_KEYS = ("host_tier_gb", "gpu_cache_mb", "working_set_window", "working_set_admission", "working_set_slots")


def _table(doc: str) -> dict[str, str]:
    rows = {}
    for line in (DOCS / doc).read_text().splitlines():
        m = ROW.match(line)
        if m:  # a row may document several keys: "`a`, `b` | 0.4, 0.7"
            names = [n.strip().strip("`") for n in m.group(1).split(",")]
            values = [v.strip() for v in m.group(2).split(",")] if len(names) > 1 else [m.group(2).strip()]
            rows.update(zip(names, values))
    return rows


def _as_doc(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    return repr(value)


def _same(doc_value: str, value) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(doc_value.replace("_", "")) == float(value)
        except ValueError:
            return False
    return doc_value == _as_doc(value)


@pytest.mark.parametrize("doc, cls, skip", [
    ("psa.md", PsaConfig, HOST_TIER_KEYS),
    ("loopserve.md", LoopServeConfig, HOST_TIER_KEYS),
    ("lastwindow.md", LastWindowConfig, ()),
    ("samkv.md", SamKVConfig, ()),
    ("host_tier.md", PsaConfig, ()),
])
def test_doc_knob_tables_match_the_config_defaults(doc, cls, skip):
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    rows = _table(doc)
    if doc == "host_tier.md":
        rows = {k: v for k, v in rows.items() if k in HOST_TIER_KEYS}
        assert set(rows) == set(HOST_TIER_KEYS)
    checked = {k: v for k, v in rows.items() if k in defaults}
    documented = set(HOST_TIER_KEYS) if doc == "host_tier.md" else set(defaults) - set(skip)
    assert documented <= set(checked), f"{doc}: knobs without a table row: {sorted(documented - set(checked))}"
    wrong = {k: (v, defaults[k]) for k, v in checked.items() if not _same(v, defaults[k])}
    assert wrong == {}, f"{doc}: table default != config default: {wrong}"
