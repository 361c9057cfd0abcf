"""Prometheus ``/metrics`` scraping for the serving benchmarks: a one-shot scrape of named samples and a
background sampler of the running / queued request gauges (``bench/host_tier_concurrency.py``)."""

from __future__ import annotations

import math
import threading
import time

import requests

GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
COUNTERS = ("sglang:num_retracted_requests_total", "sglang_sparse:host_tier_loaded_tokens_total",
            "sglang_sparse:host_tier_saved_tokens_total", "sglang_sparse:host_tier_loads_total",
            "sglang_sparse:host_tier_failed_loads_total", "sglang:hicache_host_used_tokens")


def scrape_metrics(url: str, names: tuple[str, ...], timeout_s: float = 5.0) -> dict[str, float] | None:
    """Samples of ``names`` from ``/metrics`` (the max over label sets); None when unreachable."""
    try:
        text = requests.get(url + "/metrics", timeout=timeout_s).text
    except requests.RequestException:
        return None
    return parse_metrics(text, names)


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {name: value} for the wanted names (labels dropped, max over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key = line.split("{", 1)[0].split(" ", 1)[0]
        if key in names:
            try:
                v = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[key] = max(v, out.get(key, -math.inf))
    return out


class MetricsSampler:
    """Background thread polling the server's running / queued gauges every ``poll_s`` seconds."""

    def __init__(self, url: str, poll_s: float):
        self.url, self.poll_s = url, poll_s
        self.samples: list[tuple[float, float, float]] = []   # (t, running, queued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            m = scrape_metrics(self.url, GAUGES, timeout_s=max(1.0, self.poll_s * 4))
            if m and GAUGES[0] in m:
                self.samples.append((time.monotonic(), m[GAUGES[0]], m.get(GAUGES[1], 0.0)))
            self._stop.wait(self.poll_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
