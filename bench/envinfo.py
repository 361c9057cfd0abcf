"""Machine and version facts every report states (command, host, CPU/GPU, versions).

Versions are read in the interpreter that runs the *server* (``--python``), which may
differ from the driver's, via a one-shot subprocess with a bounded timeout.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone

_PROBE = r"""
import json, importlib.metadata as md
out = {}
for name in ("sglang", "sglang-sparse", "torch", "flashinfer-python", "transformers"):
    try: out[name] = md.version(name)
    except Exception: out[name] = None
try:
    import torch
    out["cuda"] = torch.version.cuda
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception as e:
    out["gpu"] = None
import sys; out["python"] = sys.version.split()[0]
print(json.dumps(out))
"""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def server_python_info(python: str, timeout: float = 120.0) -> dict:
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # report, do not fail the run over it
        return {"error": f"version probe failed: {e}"}


def collect(python: str, argv: list[str] | None = None) -> dict:
    """Flat dict of run facts for the report header."""
    v = server_python_info(python)
    return {
        "command": " ".join(shlex.quote(a) for a in (argv if argv is not None else [sys.executable] + sys.argv)),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.node()} {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()})",
        "gpu": v.get("gpu") or "none (CPU run)",
        "versions": ", ".join(f"{k} {v[k]}" for k in ("python", "sglang", "sglang-sparse", "torch", "cuda",
                                                       "flashinfer-python", "transformers") if v.get(k)),
    }
