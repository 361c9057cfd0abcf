"""Contract: what a client controls and the server keys caches by or keeps is bounded, with an HTTP 400 naming
the field and the server serving on: ``cache_salt`` / ``extra_key`` at most 256 characters on every route and
mode, ``custom_params`` keys reserved for the documents front door (``samkv_*``) refused, and under samkv
the number of documents and their characters capped by ``max_documents`` / ``max_document_chars``."""

from __future__ import annotations

import json

import pytest
import requests

from sglang_sparse.client_limits import MAX_KEY_CHARS, body_error
from sglang_sparse.http_guard import refusal
from tests.serverproc import start_cpu_server


def test_salt_and_extra_key_are_capped_on_openai_and_native_bodies():
    assert MAX_KEY_CHARS == 256
    assert body_error({"cache_salt": "s" * 256, "extra_key": ["k" * 256, None]}) is None
    msg, field = body_error({"messages": [], "cache_salt": "s" * 1_000_000})
    assert field == "cache_salt" and msg.startswith("'cache_salt' has 1000000 characters; at most 256")
    msg, field = body_error({"prompt": "p", "extra_key": ["ok", "k" * 257]})
    assert field == "extra_key" and msg.startswith("'extra_key[1]' has 257 characters")
    assert body_error({"extra_key": 5})[0] == "'extra_key' must be a string, got int"
    # /generate: extra_key only (cache_salt is not a field there)
    assert "'extra_key' has 300 characters" in refusal(json.dumps({"text": "t", "extra_key": "k" * 300}).encode())
    assert refusal(json.dumps({"text": "t", "extra_key": "k" * 256}).encode()) is None


def test_reserved_custom_params_keys_are_refused():
    msg, field = body_error({"custom_params": {"samkv_spans": [0, 3], "sparse": {"epsilon": 0.9}}})
    assert field == "custom_params" and "'samkv_spans'" in msg and "reserved" in msg
    assert body_error({"custom_params": {"sparse": {"epsilon": 0.9}, "mine": 1}}) is None
    native = {"text": "t", "sampling_params": {"custom_params": {"samkv_doc_ns": "x"}}}
    assert "'samkv_doc_ns'" in refusal(json.dumps(native).encode())
    batch = {"text": ["a", "b"], "sampling_params": [{}, {"custom_params": {"samkv_variant": "reuse"}}]}
    assert "'samkv_variant'" in refusal(json.dumps(batch).encode())
    assert refusal(json.dumps({"text": "t", "sampling_params": {"custom_params": {"x": 1}}}).encode()) is None


@pytest.fixture(scope="module")
def limits_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    handle = start_cpu_server(default_model, log, mode="samkv",
                              sparse_config='{"max_documents": 3, "max_document_chars": 2000}')
    try:
        yield handle
    finally:
        handle.stop()


def _chat(server, **extra):
    return requests.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
        **extra})


@pytest.mark.server
@pytest.mark.parametrize("route,extra,field,fragment", [
    ("chat", {"cache_salt": "s" * 1_000_000}, "cache_salt", "'cache_salt' has 1000000 characters; at most 256"),
    ("chat", {"cache_salt": "s" * 257, "documents": ["a doc"]}, "cache_salt", "'cache_salt' has 257 characters"),
    ("completions", {"extra_key": "k" * 5000}, "extra_key", "'extra_key' has 5000 characters"),
    ("chat", {"custom_params": {"samkv_spans": [0, 1]}}, "custom_params", "'samkv_spans'"),
    ("chat", {"documents": ["d"] * 4}, None, "'documents' holds 4 documents; at most 3 are allowed"),
    ("chat", {"documents": ["x" * 1500, "y" * 600]}, None,
     "'documents' is too long: 2100 characters up to 'documents[1]' exceed the limit of 2000"),
    ("generate", {"extra_key": "k" * 100_000}, "extra_key", "'extra_key' has 100000 characters"),
    ("generate", {"sampling_params": {"max_new_tokens": 2, "custom_params": {"samkv_doc_ns": "x"}}},
     "sampling_params.custom_params", "'samkv_doc_ns'"),
], ids=["salt_1MB", "salt_257_documents", "extra_key", "reserved_custom", "documents_count", "documents_chars",
        "generate_extra_key", "generate_reserved_custom"])
def test_client_controlled_sizes_past_their_cap_are_400_naming_the_field(limits_server, route, extra, field,
                                                                        fragment):
    if route == "generate":
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, **extra}
        r = requests.post(limits_server.url + "/generate", json=body, timeout=300)
    elif route == "completions":
        r = requests.post(limits_server.url + "/v1/completions", timeout=300,
                          json={"model": "default", "prompt": "Hi", "max_tokens": 2, **extra})
    else:
        r = _chat(limits_server, **extra)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["message"]
    if field is not None:
        assert r.json().get("param") == field
    ok = _chat(limits_server, cache_salt="s" * 256)  # at the cap: served, and the server serves on
    assert ok.status_code == 200, ok.text
    docs = _chat(limits_server, documents=["a" * 900, "b" * 900, "c" * 200], cache_salt="t" * 256)
    assert docs.status_code == 200 and docs.json()["metadata"]["sparse"]["documents"] == 3, docs.text
