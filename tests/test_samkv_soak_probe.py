"""Contract: bench.samkv_soak_probe names the soak's documents as the soak builds them, parses combinations with a
clear error, and finds a planted statement's tokens inside kept ranges (and says so when one token is missing)."""

from __future__ import annotations

import pytest

from bench.samkv_soak_probe import covered, documents, parse_combo


def test_documents_are_the_soaks_shared_and_private_documents():
    from bench.soak import SoakConfig, Workload

    docs = documents(200, 2, 0)
    w = Workload(SoakConfig(seed=0, turn_words=200, salts=2))
    assert sorted(docs) == ["P0", "P1", "S0", "S1"]
    assert docs["S1"]["text"] == w.shared[1]["text"] and docs["P1"]["text"] == w.private["soak-salt-1"]["text"]


def test_combo_parsing_names_the_bad_input():
    assert parse_combo("P1,S1:P1", {"P1", "S1"}) == (["P1", "S1"], "P1")
    for bad in ("P1,S1", "P1,S1:S0", "P9,S1:S1"):
        with pytest.raises(ValueError, match="DOC,DOC:TARGET"):
            parse_combo(bad, {"P1", "S1", "S0"})


def test_statement_coverage_needs_every_token():
    assert covered([0, 10, 20, 40], (22, 30)) is True
    assert covered([0, 10, 20, 29], (22, 30)) is False
    assert covered(None, (1, 2)) is None
