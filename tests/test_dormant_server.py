"""Contract (CPU server): a mode whose ``min_context`` no request can reach on the served model (psa's default
32768 and lastwindow's 65536 on the 8k default model) is dormant: the start-up log says so, ``/server_info`` reports
``engagement.dormant`` with the stock attention backend and no counters, and requests are served exactly as by
``--sparse off`` (same greedy output, no per-request ``metadata.sparse``, since nothing of the mode ran)."""

from __future__ import annotations

import pytest
import requests

from tests.serverproc import chat, start_cpu_server
from tests.test_psa_server import _long_prompt

pytestmark = pytest.mark.server


DEFAULT_MIN_CONTEXT = {"psa": 32768, "lastwindow": 65536}  # the defaults, both beyond the 8k model's sequences


@pytest.fixture(scope="module", params=sorted(DEFAULT_MIN_CONTEXT))
def dormant_server(request, default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"{request.param}_defaults") / "server.log"
    handle = start_cpu_server(default_model, log, mode=request.param)
    try:
        yield request.param, handle, log
    finally:
        handle.stop()


def test_a_mode_that_cannot_engage_serves_exactly_as_off(dormant_server, cpu_server):
    mode, server, log = dormant_server
    min_context = DEFAULT_MIN_CONTEXT[mode]
    state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]
    assert state["mode"] == mode and state["attention_backend"] == "TorchNativeAttnBackend", state
    assert state["engagement"] == {"min_context": min_context, "context_length": 8192, "longest_sequence": 8191,
                                   "reachable": False, "dormant": True}
    assert state["stats"] is None
    text = log.read_text(errors="replace")
    assert f"min_context {min_context} is above the longest sequence" in text and "so the mode is dormant" in text
    content = _long_prompt()
    got = chat(server, content, 16)
    want = chat(cpu_server, content, 16)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert "sparse" not in (got.get("metadata") or {})
