"""Statistics of the host-tier concurrency benchmark (``bench/host_tier_concurrency.py``, whose module
docstring gives the definitions): percentiles, client-side stream concurrency, one level's summary and the
SLO / ratio aggregation over servers. Pure functions, no I/O (unit-tested on synthetic numbers)."""

from __future__ import annotations

import math
import statistics

from bench.prom_metrics import COUNTERS

BASELINE = "dense"
HEADLINE = "psa_host_tier"


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def interval_concurrency(intervals: list[tuple[float, float]], t0: float, t1: float) -> tuple[float, float, int]:
    """Open intervals over [t0, t1]: (time-weighted mean, time-weighted mean while at least one is open, max)."""
    if t1 <= t0 or not intervals:
        return 0.0, 0.0, 0
    inside = [(max(a, t0), min(b, t1)) for a, b in intervals if b > t0 and a < t1 and b > a]
    events = sorted([(a, 1) for a, _ in inside] + [(b, -1) for _, b in inside])  # ends before starts at ties
    area, busy, cur, peak, last = 0.0, 0.0, 0, 0, t0
    for t, d in events:
        area += cur * (t - last)
        busy += (t - last) if cur > 0 else 0.0
        cur += d
        peak = max(peak, cur)
        last = t
    return area / (t1 - t0), (area / busy if busy > 0 else 0.0), peak


def summarize_level(level: int, results: list[dict], samples: list[tuple[float, float, float]],
                    t0: float, t1: float, counters0: dict | None, counters1: dict | None,
                    truncated: bool) -> dict:
    """Per-level figures from the per-request results and the /metrics samples of the level's window."""
    ok = [r for r in results if r.get("ok")]
    failed = [r for r in results if not r.get("ok")]
    wall = max(t1 - t0, 1e-9)
    ms = lambda xs, q: None if not xs else 1e3 * percentile(xs, q)  # noqa: E731
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    follow = [r for r in ok if r["turn"] > 0]
    run = [s[1] for s in samples if t0 <= s[0] <= t1]
    queue = [s[2] for s in samples if t0 <= s[0] <= t1]
    client_mean, client_busy, client_max = interval_concurrency([(r["t_first"], r["t_end"]) for r in ok], t0, t1)
    busy = [x for x in run if x > 0]
    if busy:
        sustained, source = statistics.median(busy), "server /metrics sglang:num_running_reqs (median of non-zero samples)"
    else:
        sustained, source = client_busy, "client streams between first and last token (time mean while >= 1)"
    cached = [r for r in follow if r.get("cached_tokens") is not None]
    delta = None
    if counters0 is not None and counters1 is not None:
        delta = {k: counters1.get(k, 0.0) - counters0.get(k, 0.0) for k in COUNTERS}  # absent = never incremented
    return {
        "level": level, "requests": len(results), "ok": len(ok), "failed": len(failed),
        "errors": sorted({r.get("error", "?") for r in failed})[:5], "truncated": truncated,
        "wall_s": wall, "output_tokens": sum(r["completion_tokens"] for r in ok),
        "output_tok_s": sum(r["completion_tokens"] for r in ok) / wall,
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90),
        "ttft_first_turn_ms_p50": ms([r["ttft_s"] for r in ok if r["turn"] == 0], 50),
        "ttft_followup_ms_p50": ms([r["ttft_s"] for r in follow], 50),
        "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p90": ms(tpot, 90),
        "followup_cached_fraction": (sum(r["cached_tokens"] for r in cached) /
                                     max(1, sum(r["prompt_tokens"] for r in cached))) if cached else None,
        "prompt_tokens_max": max((r["prompt_tokens"] for r in ok), default=None),
        "sustained_running": sustained, "running_source": source,
        "server_running_max": max(run) if run else None, "server_busy_samples": len(busy), "server_running_mean": statistics.fmean(run) if run else None,
        "server_queue_max": max(queue) if queue else None, "metrics_samples": len(run),
        "queued": (max(queue) > 0) if queue else None,
        "client_decoding_mean": client_mean, "client_decoding_busy_mean": client_busy,
        "client_decoding_max": client_max,
        "counter_deltas": delta,
    }


def aggregate(servers: dict[str, dict], slo_factor: float, tpot_slo_ms: float | None = None,
              baseline: str = BASELINE, headline: str = HEADLINE) -> dict:
    """The SLO, each server's concurrent long requests at the SLO, and the ratios to the baseline.

    ``servers[name]`` = ``{"levels": [summarize_level dicts], "error": str | None}``. Pure function
    (no I/O); the definitions are in the module docstring."""
    out: dict = {"slo_factor": slo_factor, "tpot_slo_ms": None, "tpot_slo_reason": None, "per_server": {}}
    if tpot_slo_ms is not None:
        out["tpot_slo_ms"], out["tpot_slo_source"] = float(tpot_slo_ms), "given (--tpot-slo-ms)"
    else:
        base = servers.get(baseline) or {}
        lv = sorted(base.get("levels") or [], key=lambda r: r["level"])
        first = lv[0] if lv else None
        if first is None:
            out["tpot_slo_reason"] = f"baseline '{baseline}' has no level" + (
                f" ({base['error']})" if base.get("error") else " (not run)")
        elif first["failed"] or first["tpot_ms_p50"] is None:
            out["tpot_slo_reason"] = f"baseline '{baseline}' level {first['level']} failed: {first['errors']}"
        else:
            out["tpot_slo_ms"] = slo_factor * first["tpot_ms_p50"]
            out["tpot_slo_source"] = f"{slo_factor} x {baseline} TPOT p50 at level {first['level']}"
    slo = out["tpot_slo_ms"]
    for name, srv in servers.items():
        levels = sorted(srv.get("levels") or [], key=lambda r: r["level"])
        row: dict = {"error": srv.get("error"), "levels_run": [r["level"] for r in levels]}
        if slo is None:
            meet = []
        else:
            meet = [r for r in levels if not r["failed"] and not r["truncated"] and r["ok"] > 0
                    and r["tpot_ms_p90"] is not None and r["tpot_ms_p90"] <= slo]
        row["levels_meeting_slo"] = [r["level"] for r in meet]
        if meet:
            best = max(meet, key=lambda r: (r["sustained_running"], r["level"]))
            row.update(concurrent_at_slo=best["sustained_running"], best_level=best["level"],
                       output_tok_s_at_best=best["output_tok_s"],
                       max_output_tok_s_at_slo=max(r["output_tok_s"] for r in meet), reason=None)
        else:
            why = (srv.get("error") or ("no TPOT SLO: " + str(out["tpot_slo_reason"])) if slo is None
                   else srv.get("error") or ("no level run" if not levels else
                                             f"no level meets TPOT p90 <= {slo:.2f} ms with all requests ok"))
            row.update(concurrent_at_slo=None, best_level=None, output_tok_s_at_best=None,
                       max_output_tok_s_at_slo=None, reason=why)
        # per level: the mean over the level's own measured admission decisions (None when it had none)
        fr = sorted(f for f in (r.get("working_set_fraction_mean") for r in levels) if f)
        row["working_set_fraction"] = statistics.median(fr) if fr else None
        out["per_server"][name] = row
    b = out["per_server"].get(baseline)
    for name, key in ((headline, "concurrency_ratio_vs_dense"), ("hicache", "hicache_concurrency_ratio_vs_dense")):
        s = out["per_server"].get(name)
        ratio, why = None, None
        if s is None:
            why = f"server '{name}' not run"
        elif b is None:
            why = f"baseline '{baseline}' not run"
        elif s["concurrent_at_slo"] is None:
            why = f"{name}: {s['reason']}"
        elif not b["concurrent_at_slo"]:
            why = f"{baseline}: {b['reason'] or 'zero running requests'}"
        else:
            ratio = s["concurrent_at_slo"] / b["concurrent_at_slo"]
        out[key], out[key + "_reason"] = ratio, why
        tp = None
        if ratio is not None and b.get("max_output_tok_s_at_slo"):
            tp = s["max_output_tok_s_at_slo"] / b["max_output_tok_s_at_slo"]
        out[key.replace("concurrency", "throughput")] = tp
    # the ceiling of concurrency_ratio_vs_dense for a host tier that keeps only working sets on the GPU
    # (SparseServe §3): a request then holds its working set instead of its whole context
    h = out["per_server"].get(headline) or {}
    frac = h.get("working_set_fraction")
    out["working_set_fraction"] = frac
    out["working_set_concurrency_bound"] = 1.0 / frac if frac else None
    out["working_set_concurrency_bound_by_server"] = {
        name: 1.0 / row["working_set_fraction"] for name, row in out["per_server"].items() if row["working_set_fraction"]}
    return out
