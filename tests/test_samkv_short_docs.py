"""Contract: the short-documents diagnosis (``python -m bench.samkv_short_docs``) asks each distinct RAG item of the
soak once, and says whether a kept context holds the planted fact (real tokenizer, no server)."""

from __future__ import annotations

import json

import pytest

from bench.samkv_short_docs import fact_in_kept, items, main, many_doc_items


def test_items_are_the_soaks_distinct_rag_items_with_the_fact_in_a_document():
    got = items(60, 120)
    assert len(got) == len({(tuple(it["documents"]), it["question"], it["salt"]) for it in got}) > 1
    assert all(any(it["answer"] in d for d in it["documents"]) for it in got)


def test_fact_in_kept_reads_the_kept_ranges_with_the_tokenizer(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    it = items(60, 120)[0]
    j = next(k for k, d in enumerate(it["documents"]) if it["answer"] in d)
    n = len(tok(it["documents"][j], add_special_tokens=False)["input_ids"])
    whole = [[0, n] if k == j else [0, 1] for k in range(len(it["documents"]))]
    none = [[0, 0] for _ in it["documents"]]
    assert fact_in_kept(tok, it, whole) is True
    assert fact_in_kept(tok, it, none) is False
    assert fact_in_kept(tok, it, None) is None


@pytest.mark.parametrize("distractors", [False, True])
def test_many_document_items_ask_about_the_one_document_that_names_the_locker(distractors):
    got = many_doc_items(12, 60, 5, distractors=distractors)
    assert len(got) == 5 and got == many_doc_items(12, 60, 5, distractors=distractors)  # planned from the seed alone
    for it in got:
        assert len(it["documents"]) == 12
        assert sum(it["prefix"] in d for d in it["documents"]) == 1  # one document names the asked locker
        assert any(it["prefix"] + " " + it["answer"] in d for d in it["documents"])
        with_a_fact = sum("The access code of the" in d for d in it["documents"])
        assert with_a_fact == (12 if distractors else 1)


@pytest.mark.parametrize("flag", [["--docs", "-1"], ["--items", "0"], ["--doc-words", "0"],
                                  ["--url", "http://10.0.0.1:30000"]])
def test_bad_arguments_stop_before_any_request(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), *flag])
    assert e.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_merge_puts_each_runs_counts_in_one_table(tmp_path):
    from bench.samkv_short_docs import WAYS, merge

    dirs = []
    for k, (docs, distractors) in enumerate(((24, False), (8, True))):
        d = tmp_path / f"run{k}"
        d.mkdir()
        row = {w: {"right": w != "samkv", "variant": "recompute" if docs == 24 else "samkv"} for w in WAYS}
        summary = {**{w: sum(r[w]["right"] for r in [row]) for w in WAYS}, "items": 1, "samkv_fact_kept": 0,
                   "samkv_assembled": 1, "document_tokens": [4600]}
        (d / "samkv_short_docs.json").write_text(json.dumps({
            "env": {"command": f"python -m bench.samkv_short_docs --docs {docs}", "gpu": "G", "versions": "V"},
            "doc_words": 100, "docs": docs, "distractors": distractors, "summary": summary, "rows": [row]}))
        dirs.append(str(d))
    doc = merge(dirs, tmp_path / "out")
    assert [(r["docs"], r["distractors"], r["default_recompute"], r["right"]["samkv"]) for r in doc["runs"]] == \
        [(24, False, 1, 0), (8, True, 0, 0)]
    md = (tmp_path / "out" / "samkv_many_short_docs.md").read_text()
    assert "| 24 x 100 | asked one only | 4600 | 0 / 1 | 1 / 1 | 1 / 1 | 1 / 1 | 1 / 1 | 0 / 1 |" in md
