"""Start, probe and stop one SGLang server (``python -m sglang.launch_server``).

The server runs in its own process group (``start_new_session``) and is stopped by
that group id only. Readiness is polled with bounded timeouts; if the process dies
first, the error carries the tail of its log.
"""

from __future__ import annotations

import os
import atexit
import signal
import threading
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests


def _exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit(143) in the main thread when nothing else handles it, so ``finally`` blocks and
    atexit handlers (which stop the servers) run instead of the process dying with its servers orphaned."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


class ServerError(RuntimeError):
    pass


STOCK = "stock"
"""The pseudo-mode of a server that is plain SGLang: no ``--sparse`` flag, and the sglang_sparse plugin not loaded
(``SGLANG_PLUGINS`` names only a plugin that does not exist, so SGLang's loader skips every installed one). It is the
baseline against which ``off`` (the plugin loaded, every request dense) is itself checked."""
NO_PLUGINS = "__none__"


@dataclass
class ServerSpec:
    """How to launch one server for one ``--sparse`` mode, or for :data:`STOCK` (plain SGLang, no plugin)."""

    python: str
    model: str
    device: str                       # "cpu" or "cuda"
    port: int
    mode: str = "off"
    sparse_config: str | None = None
    dtype: str = "bfloat16"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # variables set for this server on top of this process's
    cpus: tuple[int, ...] | None = None  # CPUs the server's processes run on (sched_setaffinity); None: any
    port_fallback: bool = True        # an HTTP port found taken at start moves to a free one (read .url after start)

    def argv(self, avoid: frozenset[int] = frozenset()) -> list[str]:
        """The launch command; ``avoid``: rendezvous ports not to pick (ones a failed start found taken)."""
        a = [self.python, "-m", "sglang.launch_server", "--model-path", self.model,
             "--dtype", self.dtype, "--port", str(self.port), "--host", "127.0.0.1"]
        if self.mode != STOCK:
            a += ["--sparse", self.mode]
        elif self.sparse_config:
            raise ValueError(f"mode '{STOCK}' runs plain SGLang and takes no sparse config "
                             f"(got {self.sparse_config!r})")
        if self.sparse_config:
            a += ["--sparse-config", self.sparse_config]
        if self.device == "cpu":
            # --sleep-on-idle: an idle CPU scheduler otherwise busy-polls its sockets and takes a core from the
            # client and from any other server on the machine; it wakes as soon as a request arrives.
            # --skip-server-warmup: readiness is a real generation anyway (/health_generate, polled by start()),
            # and SGLang's own warm-up stops a server whose front end is not up within its window, which a busy
            # 2-core box can exceed
            a += ["--device", "cpu", "--max-total-tokens", "16384", "--sleep-on-idle", "--skip-server-warmup"]
        elif self.device != "cuda":
            raise ValueError(f"device must be 'cpu' or 'cuda', got '{self.device}'")
        if "--nccl-port" not in self.extra_args:
            a += ["--nccl-port", str(rendezvous_port(self.port, probe=lambda p: p not in avoid and _bindable(p)))]
        return a + list(self.extra_args)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A port the kernel has free now on 127.0.0.1 (bound to 0 and released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_taken(message: str) -> bool:
    """Whether a failed start's message says a port was in use (torch's TCPStore or uvicorn's bind)."""
    low = message.lower()
    return "eaddrinuse" in low or "address already in use" in low


def rendezvous_port(http_port: int, probe: Callable[[int], bool] = _bindable, low: int | None = None) -> int:
    """The torch.distributed rendezvous port (``--nccl-port``) of a server on ``http_port``: below the kernel's
    ephemeral range, derived from ``http_port`` (servers on different ports get different ones), the first free one
    from there. SGLang's own default is a free ephemeral port picked at start-up and bound seconds later, which any
    client connection of the machine can take in between (``EADDRINUSE`` in ``init_process_group``)."""
    low = _ephemeral_low() if low is None else low
    span = 10000
    first = max(1024, low - span - 2000) + http_port % span
    for port in range(first, first + 64):
        if port < low and probe(port):
            return port
    raise RuntimeError(f"no free rendezvous port in [{first}, {first + 64}) below the ephemeral range ({low})")


_PIN = "import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); os.execvp(sys.argv[2], sys.argv[2:])"


def pinned_argv(argv: list[str], cpus, python: str) -> list[str]:
    """``argv`` run on ``cpus`` only: a ``python -c`` that sets its CPU affinity and execs ``argv`` (every process
    the server starts inherits it). Not ``preexec_fn``: servers are started from threads."""
    cpus = sorted(int(c) for c in cpus)
    if not cpus:
        raise ValueError("pinned_argv needs at least one CPU")
    return [python, "-c", _PIN, ",".join(map(str, cpus)), *argv]


def cpu_groups(n: int, reserve: int = 1, cpus=None, core_of: Callable[[int], tuple] | None = None) \
        -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Split this process's CPUs into ``reserve`` physical cores for the benchmark client and ``n`` equal groups of
    whole physical cores, one per server (hyper-threads of a core stay in one group; leftover cores go unused, so
    every server gets the same share). Returns ``(client_cpus, server_groups)``; raises ValueError when there are
    fewer than ``n + reserve`` cores. ``cpus`` / ``core_of`` (CPU -> physical core key): tests; default: this
    process's affinity and ``/sys/devices/system/cpu``."""
    if n < 1 or reserve < 0:
        raise ValueError(f"cpu_groups: n={n} must be >= 1 and reserve={reserve} >= 0")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    core_of = core_of or _physical_core
    cores: dict[tuple, list[int]] = {}
    for c in cpus:
        cores.setdefault(core_of(c), []).append(c)
    order = sorted(cores.values())
    per = (len(order) - reserve) // n
    if per < 1:
        raise ValueError(f"cpu_groups: {len(order)} physical cores cannot give {reserve} to the client and at "
                         f"least one to each of {n} servers")
    client = tuple(c for core in order[:reserve] for c in core)
    groups = [tuple(c for core in order[reserve + i * per: reserve + (i + 1) * per] for c in core) for i in range(n)]
    return client, groups


def _physical_core(cpu: int) -> tuple:
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((base / "physical_package_id").read_text()), int((base / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu  # no topology: every CPU its own core


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value after ``flag`` in ``argv`` (None when absent)."""
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _kernel_runner(sparse_config: str | None) -> bool:
    """Whether a ``--sparse-config`` value (JSON, or ``@file``) asks for the Triton kernels (``"runner": "kernel"``)."""
    if not sparse_config:
        return False
    text = sparse_config
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError:
            return False
    return '"runner":"kernel"' in text.replace(" ", "")


class Server:
    """Context manager around one launched server."""

    def __init__(self, spec: ServerSpec, log_path: Path, timeout_s: float = 600.0, log=print):
        self.spec, self.log_path, self.timeout_s, self.log = spec, Path(log_path), timeout_s, log
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{spec.port}"
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return self.base_url

    @property
    def pid(self) -> int | None:
        """PID of the launched server, which is also its process-group id."""
        return None if self.proc is None else self.proc.pid

    def _port_busy(self) -> bool:
        try:
            requests.get(self.base_url + "/health", timeout=2)
            return True
        except requests.RequestException:
            return False

    def environment(self) -> dict[str, str]:
        """The server process's environment: this process's, offline, without SGLang's crash diagnostics on stop,
        with the spec's ``env`` on top. A CPU server
        runs Triton (through its interpreter) only where its config asks for the kernels (``"runner": "kernel"``):
        an interpreter switched on in this process (a test session's, for its own Triton tests) would otherwise
        reach paths that a CPU server runs in torch."""
        env = dict(os.environ)
        if self.spec.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
            env["TRITON_INTERPRET"] = "1" if _kernel_runner(self.spec.sparse_config) else "0"
        env.setdefault("HF_HUB_OFFLINE", "1")
        # this launcher stops every server it starts (SIGTERM to its process group); SGLang reads the scheduler's
        # exit as a crash and sleeps 5 s before a py-spy dump / CUDA coredump of it. Set either to 1 to keep that.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        if self.spec.mode == STOCK:
            env["SGLANG_PLUGINS"] = NO_PLUGINS
        env.update(self.spec.env)
        return env

    def start(self) -> "Server":
        """Launch and wait until a real generation answers.

        A port taken between the probe and SGLang's bind (another process starting or connecting in the same
        seconds: ``EADDRINUSE``) is not a failure of the server: the rendezvous port is moved at once, and the HTTP
        port too where ``spec.port_fallback`` allows it (the new one is ``spec.port`` / :attr:`url` afterwards);
        the start is tried up to three times. Any other early exit raises :class:`ServerError` with the log tail."""
        if self._port_busy():
            raise ServerError(f"port {self.spec.port} already serves something; pick another --port")
        self._move_http_port_if_taken()
        avoid: frozenset[int] = frozenset()
        for attempt in (1, 2, 3):
            argv = self.spec.argv(avoid)
            try:
                return self._start(argv)
            except ServerError as e:
                if attempt == 3 or not _port_taken(str(e)):
                    raise
                port = _flag_value(argv, "--nccl-port")
                if f"', {self.spec.port})" in str(e):  # uvicorn: "... bind on address ('127.0.0.1', PORT): ..."
                    if not self._move_http_port_if_taken(force=True):
                        raise
                elif port is not None and "--nccl-port" not in self.spec.extra_args:
                    self.log(f"[server] rendezvous port {port} was taken before the server bound it; starting once "
                             "more on another")
                    avoid = avoid | {int(port)}
                else:
                    raise
        raise AssertionError("unreachable")

    def _move_http_port_if_taken(self, force: bool = False) -> bool:
        """Move the HTTP port to a free one when it cannot be bound now (or ``force``) and the spec allows it;
        returns whether it moved."""
        if not self.spec.port_fallback or (not force and _bindable(self.spec.port)):
            return False
        old, self.spec.port = self.spec.port, free_port()
        self.base_url = f"http://127.0.0.1:{self.spec.port}"
        self.log(f"[server] mode={self.spec.mode}: HTTP port {old} is taken by another process; using {self.spec.port}")
        return True

    def _start(self, argv: list[str]) -> "Server":
        env = self.environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.spec.cpus:
            argv = pinned_argv(argv, self.spec.cpus, self.spec.python)
        self.log(f"[server] starting mode={self.spec.mode}: {' '.join(argv)} (log: {self.log_path})")
        t0 = time.monotonic()
        with open(self.log_path, "w") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        # never leave a server behind: stopped at interpreter exit too, and a SIGTERM (e.g. `timeout`) on a
        # driver that set no handler of its own becomes a normal exit that runs this
        atexit.register(self.stop)
        _exit_on_sigterm()
        deadline = t0 + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise ServerError(f"server (mode {self.spec.mode}) exited with code {rc} "
                                  f"before becoming ready; log tail:\n{tail(self.log_path)}")
            try:
                r = requests.get(self.base_url + "/health_generate", timeout=30)
                if r.status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    self.log(f"[server] ready in {self.startup_s:.0f}s")
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)  # a start is ~20 s on CPU: a coarse poll would add up to its own length
        self.stop()
        raise ServerError(f"server (mode {self.spec.mode}) not ready after {self.timeout_s:.0f}s; "
                          f"log tail:\n{tail(self.log_path)}")

    def server_info(self) -> dict:
        r = requests.get(self.base_url + "/server_info", timeout=30)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        pgid = p.pid  # start_new_session: the group id is the child's pid
        if p.poll() is not None:  # the leader is gone (an early exit): children it left may still hold ports
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # children of the group may outlive the leader briefly; make sure the group is gone
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log(f"[server] stopped mode={self.spec.mode}")

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_target_args(ap, *, port: int, mode: str) -> None:
    """The options of a driver that benchmarks one server: ``--url`` of a running one, or ``--launch`` one
    (``--model``, ``--device``, ``--python``, ``--port``, ``--sparse-config``, ``--server-args``)."""
    import sys

    ap.add_argument("--url", help=f"a running --sparse {mode} server")
    ap.add_argument("--launch", action="store_true", help=f"start a --sparse {mode} server (needs --model)")
    ap.add_argument("--model")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--sparse-config", default=None)
    ap.add_argument("--server-args", default="")


def start_group(servers: list[Server], errors: dict, key: Callable[[Server], str] = lambda s: s.spec.mode) -> list[Server]:
    """Start ``servers`` at once (a thread each) and wait for them; returns those that came up. A failure goes to
    ``errors[key(server)]``; an interruption (Ctrl-C, SIGTERM) stops every server of the group, then re-raises."""
    aborted = threading.Event()

    def go(s):
        try:
            s.start()
        except Exception as e:  # noqa: BLE001 - reported per server
            errors[key(s)] = "server start interrupted" if aborted.is_set() else \
                f"server start: {type(e).__name__}: {e}"
            s.log(f"[server] {key(s)} did not start: {errors[key(s)]}")
    threads = [threading.Thread(target=go, args=(s,), daemon=True) for s in servers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:
        aborted.set()
        stop_all(servers, threads)
        raise
    return [s for s in servers if s.proc is not None and s.startup_s is not None]


def stop_all(servers: list[Server], threads=()) -> None:
    """Stop ``servers``, each by its own process group, in parallel; with ``threads`` (start threads that may still
    be launching), keep stopping until they are done (at most 120 s)."""
    stoppers = [threading.Thread(target=s.stop) for s in servers]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    deadline = time.monotonic() + 120
    while True:
        for s in servers:
            s.stop()
        if not any(t.is_alive() for t in threads) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for s in servers:
        s.stop()
