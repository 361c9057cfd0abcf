"""Contract (CPU server, issue #6 item 1): under ``--sparse loopserve`` with ``host_tier_gb > 0`` the line sets of
a radix node travel with it to the host tier and back. Turn 1 of a conversation is prefilled sparsely (its
lines stored on its radix node), two other prompts evict that node to the host, and turn 2 (turn 1 + its
answer + a new question) loads it back from the host AND reuses turn 1's lines: the host tier's counters show
the load and the lines re-attached, loopserve's show reused lines > 0 for turn 2 (both read from
``/server_info`` and ``/metrics``). Before the lines travelled, the reloaded node served without them
(reused lines 0). The prompts share no first token, so no node that stayed on the device holds turn 1's
lines."""

from __future__ import annotations

import time

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import sparse_metrics, sparse_metrics_when, start_cpu_server

pytestmark = pytest.mark.server

MAX_TOTAL = 1600  # KV pool: room for two ~700-token prompts, so the third evicts the least recently used
MIN_CONTEXT = 256


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("host_tier_lines") / "server.log"
    handle = start_cpu_server(
        default_model, log, mode="loopserve",
        sparse_config=f'{{"min_context": {MIN_CONTEXT}, "alpha": 0.97, "host_tier_gb": 0.1, "gpu_cache_mb": 8}}',
        extra_args=("--enable-metrics", "--max-total-tokens", str(MAX_TOTAL)))
    try:
        yield handle, log
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


def _generate(server, ids: list[int]) -> dict:
    r = requests.post(server.url + "/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    r.raise_for_status()
    return r.json()


def _sparse(server) -> dict:
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]


def test_turn_two_reuses_turn_one_lines_after_its_node_came_back_from_the_host(server, tok):
    server, log = server
    run_lines_travel(server, log, tok)


def run_lines_travel(server, log, tok) -> None:
    """The contract's flow on a running loopserve + host-tier server (shared with the GPU test)."""
    # three prompts with different first words (no shared radix prefix): ~700 tokens each
    ids_a = tok.encode(f"Conversation about assignment statements.\n\n{topics['assignment'][:2600]}\n\n"
                       "Summarise the text in one sentence.")
    ids_b = tok.encode(f"Importing modules, a reference.\n\n{topics['import'][:2600]}\n\nSummarise it.")
    ids_c = tok.encode(f"Exceptions: the try statement.\n\n{topics['try'][:2600]}\n\nSummarise it.")
    assert len({ids_a[0], ids_b[0], ids_c[0]}) == 3
    assert all(MIN_CONTEXT < len(x) < MAX_TOTAL // 2 for x in (ids_a, ids_b, ids_c)), [len(ids_a), len(ids_b)]

    s0 = _sparse(server)
    turn1 = _generate(server, ids_a)
    s1 = _sparse(server)
    assert s1["stats"]["stored_turns"] >= s0["stats"]["stored_turns"] + 1  # turn 1's lines are on its node
    _generate(server, ids_b)
    _generate(server, ids_c)  # no room for three: turn 1's nodes, the least recently used, go to the host
    s2 = _sparse(server)
    ht = s2["host_tier"]
    assert ht["saved_tokens"] >= len(ids_a) - 64, ht
    assert ht["line_turns_saved"] >= 1 and ht["host_line_bytes"] > 0 and ht["host_line_turns"] >= 1, ht

    # turn 2: turn 1 + its answer + a new question
    ids_2 = ids_a + turn1["output_ids"] + tok.encode("\n\nNow list two key terms of the text.")
    turn2 = _generate(server, ids_2)
    s3 = _sparse(server)
    ht3 = s3["host_tier"]
    assert turn2["meta_info"]["cached_tokens"] >= len(ids_a) - 1       # a prefix hit ...
    assert ht3["loads"] >= ht["loads"] + 1                               # ... served from the host tier
    assert ht3["loaded_tokens"] - ht["loaded_tokens"] >= len(ids_a) - 64 and ht3["failed_loads"] == 0
    assert ht3["line_turns_restored"] >= ht["line_turns_restored"] + 1, ht3
    reused = s3["stats"]["reused_lines"] - s2["stats"]["reused_lines"]   # turn 2 is the only request since s2
    assert reused > 0, (s2["stats"], s3["stats"], ht3)
    assert s3["stats"]["sparse_prefills"] == s2["stats"]["sparse_prefills"] + 1

    # /metrics tells the same story
    m = sparse_metrics_when(server, "sglang_sparse:", "sglang_sparse:loopserve_reused_lines_total",
                            lambda v: v >= s3["stats"]["reused_lines"])
    assert m["sglang_sparse:loopserve_reused_lines_total"] == s3["stats"]["reused_lines"]
    assert m["sglang_sparse:host_tier_restored_line_turns_total"] >= 1
    assert m["sglang_sparse:host_tier_loads_total"] >= 1
    print(f"\n[host_tier_lines] turn 2: cached {turn2['meta_info']['cached_tokens']} of {len(ids_2)} tokens, "
          f"host loads {ht3['loads'] - ht['loads']} ({ht3['loaded_tokens'] - ht['loaded_tokens']} tokens), "
          f"line turns restored {ht3['line_turns_restored'] - ht['line_turns_restored']}, reused lines {reused}, "
          f"host line bytes at save {ht['host_line_bytes']}")
    assert sparse_metrics(server, "sglang_sparse:host_tier_host_line_bytes")

    time.sleep(1)  # idle: SGLang's scheduler runs its KV leak check as soon as it is idle (it raises and aborts on a leak)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    text = log.read_text(errors="replace").lower()
    assert "leak" not in text and "traceback" not in text
