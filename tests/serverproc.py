"""Test helpers around the project's one server launcher (:mod:`bench.server`).

One real SGLang server per fixture, started in its own process group with bounded waits and
stopped by that group only (never by name).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from bench.server import Server, ServerError, ServerSpec

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"


def chat(server, messages, max_tokens: int, *, timeout: float = 600, **extra) -> dict:
    """Greedy ``/v1/chat/completions`` against a test server (a str is one user message); raises on HTTP errors."""
    import requests

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    r = requests.post(server.url + "/v1/chat/completions", timeout=timeout, json={
        "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all bound at once before any is released, so none is handed out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def server_env() -> dict[str, str]:
    """Environment for SGLang subprocesses of the tests (offline, one OpenMP thread)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def start_cpu_server(model: Path, log_path: Path, *, mode: str = "off", sparse_config: str | None = None,
                     extra_args: tuple[str, ...] = (), timeout_s: float = 480.0, port: int | None = None) -> Server:
    """Start a CPU server (bf16, bounded KV pool) and wait until it serves; raises with the log tail.
    ``port``: the HTTP port (default: a free one); its torch.distributed rendezvous port is derived from it, below the
    ephemeral range (:func:`bench.server.rendezvous_port`)."""
    port = port if port is not None else free_port()
    spec = ServerSpec(python=sys.executable, model=str(model), device="cpu", port=port, mode=mode,
                      sparse_config=sparse_config, extra_args=list(extra_args))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return Server(spec, log_path, timeout_s=timeout_s, log=print).start()


MAX_PARALLEL_STARTS = 2  # a start is mostly single-threaded imports: two overlap on two cores, more only contend


def start_cpu_servers(model: Path, *specs: dict) -> list[Server]:
    """Start several CPU servers, at most :data:`MAX_PARALLEL_STARTS` at once (each ``specs`` item: keyword arguments
    of :func:`start_cpu_server`, with ``log_path``; no ``port``). A server that exits before it is ready is started
    once more on its own: SGLang stops a server whose HTTP front end is not up within its warm-up window, which a
    busy 2-core box can exceed; a server that cannot start fails twice. Returns the handles in order; if a start
    still fails, the ones that started are stopped and the first error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    # every server's HTTP port chosen together (its rendezvous port follows from it): servers started at once never
    # pick the same ports
    ports = free_ports(len(specs))
    with ThreadPoolExecutor(min(len(specs), MAX_PARALLEL_STARTS)) as pool:
        futs = [pool.submit(start_cpu_server, model, **spec, port=ports[i])
                for i, spec in enumerate(specs)]
        done = [(f.result() if f.exception() is None else f.exception()) for f in futs]
    for i, d in enumerate(done):
        if isinstance(d, ServerError) and "before becoming ready" in str(d):
            print(f"[serverproc] server {i} exited before it was ready; starting it once more alone")
            try:
                done[i] = start_cpu_server(model, **specs[i])
            except BaseException as e:  # noqa: BLE001 - reported below with the others
                done[i] = e
    errors = [d for d in done if isinstance(d, BaseException)]
    if errors:
        for d in done:
            if not isinstance(d, BaseException):
                d.stop()
        raise errors[0]
    return done


def sparse_metrics(server, prefix: str) -> dict[str, float]:
    """The server's ``/metrics`` samples whose names start with ``prefix`` (labels dropped)."""
    import requests

    text = requests.get(server.url + "/metrics", timeout=30).text
    return {line.split()[0].split("{")[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def sparse_metrics_when(server, prefix: str, key: str, pred, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics of the scheduler are exported through files: poll until ``pred(value of key)`` (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = sparse_metrics(server, prefix)
        if pred(m.get(key, 0.0)) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def flush_cache(server, timeout_s: float = 60.0) -> None:
    """``/flush_cache``, waiting (SGLang's ``timeout`` query) until the scheduler has no running or waiting request:
    right after a reply the scheduler may still be finishing it, and an immediate flush is refused with a 400."""
    import requests

    requests.post(server.url + "/flush_cache", params={"timeout": timeout_s}, timeout=timeout_s + 30).raise_for_status()


def ask_documents_first_token(url: str, task, variant: str, max_tokens: int = 10, timeout: float = 600.0):
    """A samkv documents chat request for ``task`` (bench.samkv_bench.SamKVTask: its documents, the question
    about its name) with greedy decoding: ``(text, {token: logprob} of the first token's top 5, metadata.sparse)``."""
    import requests

    q = f"What is {task.name}'s secret number? Answer the question above with the number only."
    r = requests.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": "default", "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
        "temperature": 0, "logprobs": True, "top_logprobs": 5, "documents": list(task.documents),
        "samkv": {"variant": variant}})
    assert r.status_code == 200, r.text
    j = r.json()
    first = j["choices"][0]["logprobs"]["content"][0]
    return (j["choices"][0]["message"]["content"], {t["token"]: t["logprob"] for t in first["top_logprobs"]},
            j["metadata"]["sparse"])
