"""Contract: what a client controls and the server keys caches by or keeps is bounded, with an HTTP 400 naming
the field and the server serving on: ``cache_salt`` / ``extra_key`` at most 256 characters on every route and
mode, ``custom_params`` keys reserved for the documents front door (``samkv_*``) refused, and under samkv
the number of documents and their characters capped by ``max_documents`` / ``max_document_chars``."""

from __future__ import annotations

import json


from sglang_sparse.client_limits import MAX_KEY_CHARS, body_error
from sglang_sparse.http_guard import refusal


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


# The server-backed form of these caps (a 400 naming the field on every route, the server serving on) runs on the
# shared samkv server: tests/test_samkv_server.py::test_client_controlled_sizes_past_their_cap_are_400_naming_the_field
