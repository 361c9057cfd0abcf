"""Contract (CPU server): a mode whose ``min_context`` no request can reach on the served model (psa's default
32768 on the 8k default model) is dormant: the start-up log says so, ``/server_info`` reports
``engagement.dormant`` with the stock attention backend and no counters, and requests are served exactly as by
``--sparse off`` (same greedy output, no per-request ``metadata.sparse``, since nothing of the mode ran)."""

from __future__ import annotations

import pytest
import requests

from tests.serverproc import chat, start_cpu_server
from tests.test_psa_server import _long_prompt

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def dormant_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("psa_defaults") / "server.log"
    handle = start_cpu_server(default_model, log, mode="psa")
    try:
        yield handle, log
    finally:
        handle.stop()


def test_a_mode_that_cannot_engage_serves_exactly_as_off(dormant_server, cpu_server):
    server, log = dormant_server
    state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]
    assert state["mode"] == "psa" and state["attention_backend"] == "TorchNativeAttnBackend", state
    assert state["engagement"] == {"min_context": 32768, "context_length": 8192, "longest_sequence": 8191,
                                   "reachable": False, "dormant": True}
    assert state["stats"] is None
    text = log.read_text(errors="replace")
    assert "min_context 32768 is above the longest sequence" in text and "so the mode is dormant" in text
    content = _long_prompt()
    got = chat(server, content, 16)
    want = chat(cpu_server, content, 16)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert "sparse" not in (got.get("metadata") or {})
