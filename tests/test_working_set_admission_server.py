"""Contract (CPU server, issue #6 item 3): under ``--sparse psa`` with the host tier, a waiting request joins
the running batch only while the running requests' measured working sets plus the newcomers' estimates fit
the GPU unit cache. Under pressure requests wait in SGLang's queue: every request still completes with all
its tokens, and SGLang's idle KV-leak check stays silent (the scheduler aborts on a leak). When the cache
holds less than one request's working set, requests run one at a time and give exactly the replies they
give alone. With a cache that holds everything, nothing is held back. The decisions are read from the
server's /server_info and /metrics, not from logs. (Replies of concurrently batched requests are not
compared with solo ones: SGLang's CPU decode is not batch-invariant.)"""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import sparse_metrics_when, start_cpu_servers

pytestmark = pytest.mark.server

TOPICS = ("assert", "class", "for", "if")
MAX_NEW = 24


def _prompt(topic: str) -> str:
    return f"Read this text.\n\n{topics[topic][:2000]}\n\nSummarise the text in one sentence."


def _generate(server, text: str) -> tuple[str, int]:
    r = requests.post(server.url + "/generate", timeout=900, json={
        "text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    out = r.json()
    return out["text"], out["meta_info"]["completion_tokens"]


def _state(server) -> dict:
    return server.server_info()["internal_states"][0]["sparse"]


def _serve(default_model, tmp_path_factory, *servers: tuple[str, float, bool]) -> dict:
    """Fresh psa + host-tier servers started at once, one per ``(name, gpu_cache_mb, working_set_admission)``:
    {name: (server, log)}."""
    specs, logs = [], []
    for name, gpu_cache_mb, admission in servers:
        cfg = {"min_context": 256, "host_tier_gb": 0.1, "gpu_cache_mb": gpu_cache_mb, "working_set_window": 4,
               "working_set_admission": admission, "dense_above": 1.0}
        logs.append(tmp_path_factory.mktemp(f"ws_{name}") / "server.log")
        specs.append(dict(log_path=logs[-1], mode="psa", sparse_config=json.dumps(cfg),
                          extra_args=("--enable-metrics", "--max-total-tokens", "6000")))
    handles = start_cpu_servers(default_model, *specs)
    return {name: (h, log) for (name, _, _), h, log in zip(servers, handles, logs)}


def _alone_replies(server) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy reply when it runs alone (one request at a time, on a server that holds none back)."""
    return {t: _generate(server, _prompt(t)) for t in TOPICS}


def _concurrent(server) -> dict[str, str]:
    with cf.ThreadPoolExecutor(len(TOPICS)) as pool:
        futs = {t: pool.submit(_generate, server, _prompt(t)) for t in TOPICS}
        return {t: f.result() for t, f in futs.items()}


@pytest.fixture(scope="module")
def ws_servers(default_model, tmp_path_factory):
    """The three admission-on servers of the tests below, started together; each test stops its own when done.
    ``ample`` (a cache that holds every working set) also gives the solo replies, one request at a time."""
    servers = _serve(default_model, tmp_path_factory, ("serial", 6.0, True), ("tight", 16.0, True),
                     ("ample", 512.0, True))
    try:
        yield servers
    finally:
        for server, _ in servers.values():
            server.stop()


def test_a_cache_smaller_than_one_working_set_serialises_requests_with_solo_replies(ws_servers):
    # 6 MiB of unit cache = 1536 units (30 layers x 3 KV heads x 16-token blocks): less than one prompt's context;
    # the solo replies come from the ample server (nothing is ever held there), played one at a time while this
    # one runs
    (alone, _), (server, log) = ws_servers["ample"], ws_servers["serial"]
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            alone_replies = pool.submit(_alone_replies, alone)
            replies, ws = _concurrent(server), _state(server)["working_set"]
            alone_replies = alone_replies.result()
    finally:
        server.stop()
    assert replies == alone_replies  # one at a time: exactly the solo greedy replies, none dropped
    assert ws["oversize_admissions"] >= len(TOPICS) - 1 and ws["held_requests"] > 0, ws
    assert "leak" not in log.read_text().lower()


def test_requests_wait_while_measured_working_sets_fill_the_gpu_cache(ws_servers):
    # 16 MiB = 4096 units: one prompt's whole context (~2600 units) fits, a second only once the first's
    # measured working set (what PSA read in its last 4 steps) is known to leave room for it
    server, log = ws_servers["tight"]
    try:
        check_admission_under_pressure(server, log)
    finally:
        server.stop()


def check_admission_under_pressure(server, log) -> dict:
    """Send the prompts at once to a psa + host-tier server whose unit cache holds ~1.5 of their contexts;
    check requests were held back on measured working sets and all completed in full (shared with the GPU
    test)."""
    replies = _concurrent(server)
    ws = _state(server)["working_set"]
    m = sparse_metrics_when(server, "sglang_sparse:ws_", "sglang_sparse:ws_admission_held_requests_total",
                            lambda v: v > 0)
    print("working set admission (tight):", ws)
    assert all(n == MAX_NEW for _, n in replies.values()), replies  # every request completed in full
    assert ws["decisions"] > 0 and ws["limited"] > 0 and ws["held_requests"] > 0, ws
    assert ws["measured_decisions"] > 0, ws  # decisions used working sets measured by the PSA runner
    # the cumulative sum a client turns into an interval's mean fraction: each term is in (0, 1]
    assert 0 < ws["working_set_fraction_sum"] <= ws["measured_decisions"], ws
    assert ws["peak_planned_units"] <= ws["capacity_units"], ws
    assert m["sglang_sparse:ws_admission_held_requests_total"] == ws["held_requests"], (m, ws)
    assert m["sglang_sparse:ws_capacity_units"] == ws["capacity_units"]
    assert "leak" not in log.read_text().lower()
    return ws


def test_nothing_waits_when_the_gpu_cache_holds_every_working_set(ws_servers):
    server, _ = ws_servers["ample"]
    try:
        replies, ws = _concurrent(server), _state(server)["working_set"]
    finally:
        server.stop()
    print("working set admission (ample):", ws)
    assert all(n == MAX_NEW for _, n in replies.values()), replies
    assert ws["decisions"] > 0 and ws["limited"] == 0 and ws["held_requests"] == 0, ws
