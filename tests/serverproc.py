"""Start and stop one real SGLang server for tests (bounded waits, stopped by its own process group).

Used by the ``cpu_server`` fixture in ``conftest.py`` and by tests that need a server of
their own. Never stops anything it did not start: the handle keeps the Popen of the
process it launched (``start_new_session=True``: the server's PID is its process group).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
READY_LINE = "The server is fired up and ready to roll"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_server_args(model: Path, port: int, *extra: str) -> list[str]:
    """The CPU recipe: --device cpu, fixed dtype, a bounded KV pool."""
    return ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--dtype", "bfloat16", "--max-total-tokens", "16384", *extra]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if READY_LINE in self.log_path.read_text(errors="replace"):
                    r = requests.get(self.url + "/v1/models", timeout=5)
                    if r.status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return
            except (OSError, requests.RequestException):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM then SIGKILL the server's own process group."""
        pgid = self.proc.pid
        if not pgid or self.proc.poll() is not None and not _group_alive(pgid):
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    return
                time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def start_server(args: list[str], log_path: Path, python: str = sys.executable) -> ServerHandle:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen([python, "-m", "sglang.launch_server", *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=server_env(), start_new_session=True, cwd=str(REPO))
    log.close()
    return ServerHandle(proc=proc, port=int(args[args.index("--port") + 1]), log_path=log_path)
