"""Contract (CPU server, issue #6 item 3 under ``--sparse loopserve``): LoopServe's decode records the tokens each
step attends (per layer and KV head, as KV-page units) into the working-set tracker, and the scheduler's
working-set admission uses those measured working sets as it does under ``--sparse psa``
(tests/test_working_set_admission_server.py): with a GPU unit cache that holds about one prompt's context,
waiting requests are held back in SGLang's queue, every request still completes with all its tokens, and
SGLang's idle KV-leak check stays silent; with a cache that holds everything, nothing is held back. The
decisions are read from the server's /server_info and /metrics, not from logs."""

from __future__ import annotations

import json

import pytest

from tests.serverproc import start_cpu_servers
from tests.test_working_set_admission_server import MAX_NEW, _concurrent, _state, check_admission_under_pressure

pytestmark = pytest.mark.server

# LoopServe sparse from 256 tokens (the prompts are ~450), top-B of 32 tokens per KV head: a working set well
# below the context; --page-size 1 (the CPU default): a unit is one token of one layer and KV head (256 B of K+V)
CONFIG = {"min_context": 256, "alpha": 0.9, "budget": 32, "host_tier_gb": 0.1, "working_set_window": 4,
          "working_set_slots": 8}


def serve_loopserve(default_model, tmp_path_factory, *servers: tuple[str, float]) -> dict:
    """Fresh loopserve + host-tier servers started at once, one per ``(name, gpu_cache_mb)``: {name: (server, log)}."""
    specs, logs = [], []
    for name, gpu_cache_mb in servers:
        logs.append(tmp_path_factory.mktemp(f"ws_ls_{name}") / "server.log")
        cfg = dict(CONFIG, gpu_cache_mb=gpu_cache_mb)
        specs.append(dict(log_path=logs[-1], mode="loopserve", sparse_config=json.dumps(cfg),
                          extra_args=("--enable-metrics", "--max-total-tokens", "6000")))
    handles = start_cpu_servers(default_model, *specs)
    return {name: (h, log) for (name, _), h, log in zip(servers, handles, logs)}


@pytest.fixture(scope="module")
def tight_and_ample(default_model, tmp_path_factory):
    """The servers of the two tests below, started together; each test stops its own when done."""
    servers = serve_loopserve(default_model, tmp_path_factory, ("tight", 12.0), ("ample", 512.0))
    try:
        yield servers
    finally:
        for server, _ in servers.values():
            server.stop()


def test_loopserve_requests_wait_while_measured_working_sets_fill_the_gpu_cache(tight_and_ample):
    # 12 MiB = 49152 units: one prompt's whole context (~480 tokens x 30 layers x 3 KV heads = ~43k units) fits,
    # a second only once the first's measured working set (what LoopServe attended in its last 4 steps) leaves room
    server, log = tight_and_ample["tight"]
    try:
        ws = check_admission_under_pressure(server, log)
        stats = _state(server)["stats"]
    finally:
        server.stop()
    # the mean measured fraction over the decisions (the last decision's own fraction is None when no request
    # was running then): LoopServe's working sets are smaller than the contexts
    assert ws["measured_decisions"] > 0 and 0 < ws["working_set_fraction_sum"] / ws["measured_decisions"] < 1.0, ws
    assert ws["tracked_slots"] == CONFIG["working_set_slots"], ws
    assert stats["sparse_decode_rows"] > 0, stats  # the working sets came from LoopServe's sparse decode


def test_loopserve_nothing_waits_when_the_gpu_cache_holds_every_working_set(tight_and_ample):
    server, log = tight_and_ample["ample"]
    try:
        replies = _concurrent(server)
        ws = _state(server)["working_set"]
    finally:
        server.stop()
    print("loopserve working set admission (ample):", ws)
    assert all(n == MAX_NEW for _, n in replies.values()), replies
    assert ws["decisions"] > 0 and ws["limited"] == 0 and ws["held_requests"] == 0, ws
    assert "leak" not in log.read_text().lower()
