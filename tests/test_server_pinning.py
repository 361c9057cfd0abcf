"""Contract: ``bench.server`` gives each server a rendezvous port outside the ephemeral range (a start that loses it
to another process before binding it is started once more on another), and can run a server
on a given set of CPUs (the A/B driver's ``--pin-cpus``): the groups are equal, disjoint, made of whole physical
cores and leave the client its own core; a pinned command really runs with that affinity, and so do the processes
it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.server import cpu_groups, pinned_argv


def test_groups_are_equal_disjoint_whole_cores_with_one_for_the_client():
    core_of = lambda c: (0, c % 8)  # 16 CPUs, 8 physical cores: CPU c and c + 8 are hyper-threads of one core
    client, groups = cpu_groups(3, reserve=1, cpus=range(16), core_of=core_of)
    assert client == (0, 8)
    assert groups == [(1, 9, 2, 10), (3, 11, 4, 12), (5, 13, 6, 14)]  # core 7 left over: every server gets 2 cores
    seen = [c for g in groups for c in g] + list(client)
    assert len(seen) == len(set(seen))


def test_too_few_cores_is_refused_naming_the_counts():
    with pytest.raises(ValueError, match="2 physical cores cannot give 1 to the client and at least one to each of 2"):
        cpu_groups(2, reserve=1, cpus=[0, 1], core_of=lambda c: (0, c))
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        cpu_groups(0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_pinned_command_and_its_children_run_on_the_given_cpus():
    cpu = min(os.sched_getaffinity(0))
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " \
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    out = subprocess.run(pinned_argv([sys.executable, "-c", child], [cpu], sys.executable), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == [f"[{cpu}]", f"[{cpu}]"]


def test_rendezvous_ports_sit_below_the_ephemeral_range_and_follow_the_http_port():
    """A server's --nccl-port is not a free ephemeral port picked at start-up (a client connection can take it before
    SGLang binds it): it is derived from the HTTP port, below the ephemeral range, skipping ports in use."""
    from bench.server import ServerSpec, rendezvous_port

    taken = {20768 + 4321}
    got = [rendezvous_port(p, probe=lambda port: port not in taken, low=32768) for p in (30010, 34321, 44321)]
    assert got[0] == 20768 + 10 and got[1] == 20768 + 4322 and got[2] == 20768 + 4322
    assert all(g < 32768 for g in got)
    with pytest.raises(RuntimeError, match="no free rendezvous port"):
        rendezvous_port(30010, probe=lambda port: False, low=32768)
    argv = ServerSpec(python="python", model="m", device="cpu", port=31234).argv()
    assert argv[argv.index("--nccl-port") + 1] == str(rendezvous_port(31234))
    own = ServerSpec(python="python", model="m", device="cpu", port=31234, extra_args=["--nccl-port", "29000"]).argv()
    assert own.count("--nccl-port") == 1 and "29000" in own


def test_a_cpu_server_gets_the_triton_interpreter_only_when_its_config_asks_for_the_kernels(tmp_path, monkeypatch):
    """A test session runs with TRITON_INTERPRET=1 (tests/flashinfer_ext/conftest.py); a CPU server started from it must
    not inherit it, or Triton kernels would run where a real CPU server runs torch (a steady LoopServe decode step
    once crashed a real CPU server, hidden that way). `"runner": "kernel"` turns it on; the spec's env wins."""
    from bench.server import Server, ServerSpec

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def env_of(**kw):
        return Server(ServerSpec(python="python", model="m", port=31235, **kw), tmp_path / "s.log").environment()

    assert env_of(device="cpu", mode="loopserve", sparse_config='{"min_context": 256}')["TRITON_INTERPRET"] == "0"
    assert env_of(device="cpu", mode="psa", sparse_config='{"runner": "kernel"}')["TRITON_INTERPRET"] == "1"
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"loopserve": {"runner" : "kernel"}}')
    assert env_of(device="cpu", mode="loopserve", sparse_config=f"@{cfg}")["TRITON_INTERPRET"] == "1"
    assert env_of(device="cpu", env={"TRITON_INTERPRET": "1"})["TRITON_INTERPRET"] == "1"
    assert env_of(device="cuda")["TRITON_INTERPRET"] == "1"  # a GPU server is left as it is


def test_a_launched_server_skips_sglangs_crash_diagnostics_on_stop_unless_asked(tmp_path, monkeypatch):
    """The launcher stops its servers by SIGTERM to the process group; SGLang reads the scheduler's exit as a crash and
    sleeps 5 s before a py-spy / CUDA core dump of it. Both dumps are off by default; the caller's setting wins."""
    from bench.server import Server, ServerSpec

    for var in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
        monkeypatch.delenv(var, raising=False)

    def env_of(**kw):
        return Server(ServerSpec(python="python", model="m", port=31236, **kw), tmp_path / "s.log").environment()

    for device in ("cpu", "cuda"):
        env = env_of(device=device)
        assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert env_of(device="cuda", env={"SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "1"})["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "1"
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    assert env_of(device="cuda")["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"


def _start_with_a_port_taken_before_the_bind(default_model, tmp_path, monkeypatch, which: str, check):
    """Start a real CPU server on a free HTTP port while ``which`` ("http" or "rendezvous") port is held by a
    listening socket and the probe is told, once, that it is free; ``check(server, held)`` runs while it is up.
    Returns ``(held port, log lines, probes lied to)``."""
    import socket

    from bench import server as srv
    from tests.serverproc import free_port

    port = free_port()
    held = port if which == "http" else srv.rendezvous_port(port)
    real = srv._bindable
    lied = []

    def probe(p, *args, **kw):
        if p == held and not lied:
            lied.append(p)
            return True  # free when probed ...
        return real(p, *args, **kw)

    monkeypatch.setattr(srv, "_bindable", probe)
    lines = []
    with socket.socket() as sock:  # ... and taken before the server binds it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", held))
        sock.listen(1)
        server = srv.Server(srv.ServerSpec(python=sys.executable, model=str(default_model), device="cpu", port=port),
                            tmp_path / "s.log", timeout_s=480, log=lines.append)
        try:
            server.start()
            check(server, held)
        finally:
            server.stop()
    assert sum("[server] starting" in x for x in lines) == 2
    return held, lines, lied


@pytest.mark.server
def test_a_start_whose_rendezvous_port_is_taken_before_the_bind_starts_once_more_on_another(default_model, tmp_path,
                                                                                             monkeypatch):
    """Two servers starting in the same seconds can race for a rendezvous port: free when probed, bound by the other
    before SGLang binds it (EADDRINUSE, the server exits). Reproduced with a real CPU server: the port is held by a
    socket while the probe is told it is free; the start logs the collision and comes up on another port."""
    def check(server, held):
        assert server.server_info()["nccl_port"] != held

    held, lines, _ = _start_with_a_port_taken_before_the_bind(default_model, tmp_path, monkeypatch, "rendezvous", check)
    assert any(f"rendezvous port {held} was taken" in x for x in lines)


@pytest.mark.server
def test_a_start_whose_http_port_is_taken_before_the_bind_comes_up_on_another_and_says_so(default_model, tmp_path,
                                                                                          monkeypatch):
    """The HTTP port can be taken between the driver's probe and uvicorn's bind too (a port of the ephemeral range:
    any client connection of the machine may hold it; SGLang then exits 3 with "address already in use"). Reproduced
    with a real CPU server: the port is held by a listening socket while the probe is told it is free; the start logs
    the collision, comes up on another port, and ``url`` / ``spec.port`` name it."""
    def check(server, held):
        assert server.spec.port != held and server.url == f"http://127.0.0.1:{server.spec.port}"
        assert server.server_info()["port"] == server.spec.port

    held, lines, lied = _start_with_a_port_taken_before_the_bind(default_model, tmp_path, monkeypatch, "http", check)
    assert lied == [held]
    assert any(f"HTTP port {held} is taken" in x for x in lines)


def test_a_group_start_that_fails_logs_why(tmp_path):
    """bench.load and bench.ab_rounds start servers in a group; a server that does not come up is logged with its
    error (not only kept in the summary), so a driver's output says why a mode has no cells."""
    from bench.server import Server, ServerSpec, start_group

    lines, errors = [], {}
    bad = Server(ServerSpec(python=sys.executable, model=str(tmp_path / "no-such-model"), device="cpu",
                            port=free_port_local(), port_fallback=False), tmp_path / "s.log", timeout_s=120,
                 log=lines.append)
    up = start_group([bad], errors)
    assert up == [] and "off" in errors
    assert any(x.startswith("[server] off did not start: server start: ServerError") for x in lines)
    assert bad.proc is None


def free_port_local() -> int:
    from tests.serverproc import free_port

    return free_port()
