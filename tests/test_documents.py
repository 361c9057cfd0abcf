"""parse_documents: the planned ``extra_body={"documents": [...]}`` field of the samkv mode."""

from __future__ import annotations

import pytest

from sglang_sparse.documents import parse_documents


def _parse(raw, max_documents=4, max_total_chars=100):
    return parse_documents(raw, max_documents=max_documents, max_total_chars=max_total_chars)


def test_valid_documents_kept_in_order_and_unchanged():
    assert _parse(["a b", " second doc \n", "x"]) == ("a b", " second doc \n", "x")
    assert _parse(["é" * 100]) == ("é" * 100,)  # exactly at the character limit
    assert _parse(["d"] * 4) == ("d",) * 4  # exactly at the count limit


@pytest.mark.parametrize("raw, pattern", [
    (None, r"'documents' must be a list of strings .*got NoneType"),
    ("one doc", r"'documents' must be a list .*got str"),
    ({"0": "doc"}, r"'documents' must be a list .*got dict"),
    (("a", "b"), r"'documents' must be a list .*got tuple"),
    ([], r"'documents' must hold at least one document, got an empty list"),
    (["ok", 3], r"'documents\[1\]' must be a string, got int"),
    (["ok", None], r"'documents\[1\]' must be a string, got NoneType"),
    ([["nested"]], r"'documents\[0\]' must be a string, got list"),
    (["ok", "ok", ""], r"'documents\[2\]' is empty"),
    ([" \n\t"], r"'documents\[0\]' is empty"),
    (["d"] * 5, r"'documents' holds 5 documents; at most 4 are allowed"),
    (["x" * 60, "y" * 41], r"'documents' is too long: 101 characters up to 'documents\[1\]' exceed "
                           r"the limit of 100 characters"),
])
def test_bad_payloads_name_field_index_and_limit(raw, pattern):
    with pytest.raises(ValueError, match=pattern):
        _parse(raw)


@pytest.mark.parametrize("kw", [{"max_documents": 0}, {"max_total_chars": -1}, {"max_documents": True},
                                {"max_total_chars": 1.5}])
def test_bad_limits_refused(kw):
    args = {"max_documents": 4, "max_total_chars": 100, **kw}
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        parse_documents(["doc"], **args)


def test_module_imports_no_sglang():
    import subprocess
    import sys

    code = "import sys, sglang_sparse.documents; assert 'sglang' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
