"""What the soak driver (:mod:`bench.soak`) reads from the server it drives, besides the answers: the
resident memory of the server's process tree (``/proc``), the GPU memory those processes hold
(``nvidia-smi``, skipped without it), the slope of RSS over the run, SGLang's ``/metrics`` counters
(skipped when the server has no ``--enable-metrics``) and SGLang's idle memory check in the server log."""

from __future__ import annotations

import os
import re
import subprocess
import time

import requests

LEAK_PATTERN = re.compile(r"memory leak detected", re.IGNORECASE)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc``), alive ones only."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if os.path.exists(f"/proc/{p}"):
            out.append(p)
            todo += children.get(p, [])
    return out


def rss_mb(pid: int) -> float | None:
    """VmRSS of ``pid`` (MiB), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return 0.0


def gpu_mb(pids: list[int]) -> float | None:
    """GPU memory (MiB) the processes hold (``nvidia-smi``); None when there is no NVIDIA GPU tool."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    used = 0.0
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            used += float(parts[1])
    return used


def sample(pid: int | None, done: int, t0: float) -> dict | None:
    if pid is None:
        return None
    pids = process_tree(pid)
    per = {p: rss_mb(p) for p in pids}
    return {"requests": done, "t_s": round(time.monotonic() - t0, 1),
            "rss_mb": round(sum(v for v in per.values() if v), 1),
            "rss_max_process_mb": round(max((v for v in per.values() if v), default=0.0), 1),
            "processes": len(pids), "gpu_mb": gpu_mb(pids)}


def slope_per_1k(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x, times 1000 (MB per 1k requests); None under two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return round(1000 * sum((x - mx) * (y - my) for x, y in points) / sxx, 2)


def last_half_slope(samples: list[dict]) -> float | None:
    if not samples:
        return None
    half = samples[-1]["requests"] / 2
    return slope_per_1k([(s["requests"], s["rss_mb"]) for s in samples if s["requests"] >= half])


METRICS = ("sglang:num_requests_total", "sglang:num_aborted_requests_total", "sglang:num_running_reqs",
           "sglang:num_queue_reqs")


def scrape(url: str) -> dict[str, float] | None:
    """Sums of the :data:`METRICS` samples (labels summed), None when ``/metrics`` is not served."""
    try:
        r = requests.get(url + "/metrics", timeout=10)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    out = {m: 0.0 for m in METRICS}
    for line in r.text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def wait_idle(url: str, timeout_s: float = 60.0) -> dict | None:
    """The metrics once nothing runs or waits (or at the timeout); None without ``/metrics``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if m is None or (m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(1)


def metrics_report(before: dict | None, after: dict | None, c: dict, mode: str) -> dict:
    """``/metrics`` deltas against the client's counts. Checked (``checks``; ``consistent`` = all of them):

    * ``finished_covers_completed``: ``sglang:num_requests_total`` grew by at least the requests completed;
    * ``finished_within_admitted``: and by no more than the requests sent minus the 4xx (None under samkv, whose
      front door adds one prefill request per new document);
    * ``idle_after_run``: no request running or queued afterwards (client-aborted streams did not stay behind).

    ``sglang:num_aborted_requests_total`` is reported (``aborted_counter``) beside the client's aborts
    (``client_aborts``), not checked against them: SGLang 0.5.17 counts only the aborts its tokenizer manager
    starts through ``abort_request`` (``/abort_request``, a non-streamed request whose client went away, a
    pause with abort). A streamed request whose client disconnects is aborted in the scheduler when its
    response generator closes, without that counter, and is not counted as finished either."""
    if before is None or after is None:
        return {"enabled": False}
    finished = after["sglang:num_requests_total"] - before["sglang:num_requests_total"]
    admitted = c["sent"] - c["http_4xx"]
    idle = after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    checks = {"finished_covers_completed": finished >= c["completed"],
              "finished_within_admitted": None if mode == "samkv" else finished <= admitted,
              "idle_after_run": idle}
    return {"enabled": True, "requests_finished": finished, "requests_completed_by_client_count": c["completed"],
            "requests_admitted_by_client_count": admitted,
            "aborted_counter": after["sglang:num_aborted_requests_total"] - before["sglang:num_aborted_requests_total"],
            "client_aborts": c["aborted"], "idle_after_run": idle, "checks": checks,
            "consistent": all(v for v in checks.values() if v is not None)}


def leak_check(log_path: str | None, offset: int = 0) -> str | None:
    """SGLang's idle memory check in the server log after byte ``offset``: "reported" / "silent"."""
    if not log_path or not os.path.exists(log_path):
        return None
    with open(log_path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode(errors="replace")
    return "reported" if LEAK_PATTERN.search(text) else "silent"
