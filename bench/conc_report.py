"""Outputs of the host-tier concurrency benchmark (``bench/host_tier_concurrency.py``): its JSON and markdown
report, and the merge of its headline keys into an existing ``host_tier.json``. ``cfg`` is that module's
``BenchConfig``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench.conc_stats import HEADLINE


def fmt(x, nd=1) -> str:
    """A number with ``nd`` decimals, ``n/a`` for None (report tables and log lines)."""
    return "n/a" if x is None else f"{x:.{nd}f}"


def write_outputs(out: Path, cfg, servers: dict, summary: dict, meta: dict, host_gb: float) -> dict:
    """``host_tier_concurrency.json`` and ``.md`` in ``out``; returns the JSON document."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"summary": summary, "config": asdict(cfg), "meta": meta, "servers": servers}
    (out / "host_tier_concurrency.json").write_text(json.dumps(doc, indent=1, default=str))
    slo = summary.get("tpot_slo_ms")
    md = ["# Host tier end to end: concurrent long multi-turn requests at a TPOT SLO", "",
          f"- command: `{meta['command']}`", f"- device: {meta['device']}", f"- model: {cfg.model_label}",
          f"- same for all servers: `--mem-fraction-static {cfg.mem_fraction_static}` (GPU), "
          f"`--max-total-tokens {cfg.max_total_tokens}` (KV pool), page {cfg.page_size if cfg.device == 'cuda' else 1}, "
          f"attention backend {cfg.attention_backend if cfg.device == 'cuda' else 'default (CPU)'}, "
          f"CUDA graphs {'off' if cfg.disable_cuda_graph else 'on'}",
          f"- host capacity: {cfg.host_ratio} x the device pool (HiCache `--hicache-ratio`; psa "
          f"`host_tier_gb` {host_gb})",
          f"- workload: per level c, c conversations at once x {cfg.turns} turns; turn 1 = {cfg.first_tokens}-token "
          f"document, later turns + {cfg.turn_tokens} tokens; {cfg.output_tokens} output tokens per turn "
          f"(ignore_eos); last-turn context ~{cfg.context_tokens} tokens",
          f"- TPOT SLO: {fmt(slo, 2)} ms ({summary.get('tpot_slo_source') or summary.get('tpot_slo_reason')})",
          f"- what the host tier does: evicted radix nodes to pinned host memory, reloaded on a prefix hit; "
          f"running requests' KV stays on the GPU (sparse decode from a GPU block cache is not implemented), "
          f"so running capacity is bounded by the same device pool as dense; psa's working-set admission "
          f"(default on) also holds waiting requests back while the running working sets fill the "
          f"{cfg.gpu_cache_mb} MiB GPU unit cache (`--gpu-cache-mb`)", "",
          "## Headline", "",
          f"- concurrency_ratio_vs_dense (psa_host_tier / dense): {fmt(summary.get('concurrency_ratio_vs_dense'), 2)}"
          + (f" ({summary['concurrency_ratio_vs_dense_reason']})" if summary.get("concurrency_ratio_vs_dense_reason")
             else ""),
          f"- hicache / dense: {fmt(summary.get('hicache_concurrency_ratio_vs_dense'), 2)}"
          + (f" ({summary['hicache_concurrency_ratio_vs_dense_reason']})"
             if summary.get("hicache_concurrency_ratio_vs_dense_reason") else ""),
          f"- best output throughput under the SLO, psa_host_tier / dense: "
          f"{fmt(summary.get('throughput_ratio_vs_dense'), 2)}; hicache / dense: "
          f"{fmt(summary.get('hicache_throughput_ratio_vs_dense'), 2)}",
          f"- psa working sets (the admission's tracker, default window of 12 decode steps) / context units of "
          f"the running requests, median over levels: {fmt(summary.get('working_set_fraction'), 3)}; ceiling of "
          f"concurrency_ratio_vs_dense for a host tier keeping only working sets on the GPU (1 / that): "
          f"{fmt(summary.get('working_set_concurrency_bound'), 2)}"
          + "".join(f"; {n}: fraction {fmt(r['working_set_fraction'], 3)}, ceiling {fmt(1 / r['working_set_fraction'], 2)}"
                    for n, r in summary["per_server"].items() if n != HEADLINE and r.get("working_set_fraction")),
          "",
          "| server | concurrent long requests at SLO | at level | out tok/s there | best out tok/s under SLO | "
          "levels meeting SLO | note |", "|---|---|---|---|---|---|---|"]
    for name, row in summary["per_server"].items():
        md.append(f"| {name} | {fmt(row['concurrent_at_slo'])} | {row['best_level'] or 'n/a'} | "
                  f"{fmt(row['output_tok_s_at_best'])} | {fmt(row['max_output_tok_s_at_slo'])} | "
                  f"{row['levels_meeting_slo']} | {row['reason'] or ''} |")
    md += ["", "## Per level", "",
           "| server | level | ok/req | out tok/s | TPOT p50 / p90 ms | meets SLO | TTFT p50 / p90 ms | TTFT turn 1 / "
           "follow-up p50 ms | follow-up cached | running (sustained / max) | client decoding (mean while busy / max) | "
           "queue max | retracted | host-tier saved / loaded tok | wall s |", "|" + "---|" * 15]
    for name, srv in servers.items():
        for r in srv["levels"]:
            d = r.get("counter_deltas") or {}
            meets = (slo is not None and not r["failed"] and not r["truncated"] and r["tpot_ms_p90"] is not None
                     and r["tpot_ms_p90"] <= slo)
            md.append(f"| {name} | {r['level']} | {r['ok']}/{r['requests']}{' (truncated)' if r['truncated'] else ''} | "
                      f"{fmt(r['output_tok_s'])} | {fmt(r['tpot_ms_p50'], 2)} / {fmt(r['tpot_ms_p90'], 2)} | "
                      f"{'yes' if meets else 'no'} | {fmt(r['ttft_ms_p50'])} / {fmt(r['ttft_ms_p90'])} | "
                      f"{fmt(r['ttft_first_turn_ms_p50'])} / {fmt(r['ttft_followup_ms_p50'])} | "
                      f"{fmt(r['followup_cached_fraction'], 2)} | {fmt(r['sustained_running'])} / "
                      f"{fmt(r['server_running_max'])} | {fmt(r['client_decoding_busy_mean'])} / {r['client_decoding_max']} | "
                      f"{fmt(r['server_queue_max'], 0)} | {fmt(d.get('sglang:num_retracted_requests_total'), 0)} | "
                      f"{fmt(d.get('sglang_sparse:host_tier_saved_tokens_total'), 0)} / "
                      f"{fmt(d.get('sglang_sparse:host_tier_loaded_tokens_total'), 0)} | {r['wall_s']:.1f} |")
    errs = [(n, s) for n, s in servers.items() if s.get("error") or s.get("skipped_levels")]
    if errs:
        md += ["", "## Errors and trimmed levels", ""]
        for n, s in errs:
            if s.get("error"):
                md.append(f"- `{n}`: {s['error'].splitlines()[0][:400]}")
            if s.get("skipped_levels"):
                md.append(f"- `{n}`: levels not run (time budget): {s['skipped_levels']}")
    md += ["", "Definitions: see the docstring of `bench/host_tier_concurrency.py` (SLO, sustained running "
               "requests = median of the non-zero samples of the server's `sglang:num_running_reqs` during the level)."]
    (out / "host_tier_concurrency.md").write_text("\n".join(md) + "\n")
    return doc


HEADLINE_KEYS = ("concurrency_ratio_vs_dense", "concurrency_ratio_vs_dense_reason",
                 "hicache_concurrency_ratio_vs_dense", "hicache_concurrency_ratio_vs_dense_reason",
                 "throughput_ratio_vs_dense", "hicache_throughput_ratio_vs_dense",
                 "working_set_fraction", "working_set_concurrency_bound", "working_set_concurrency_bound_by_server")


def merge_into(path: Path, summary: dict, cfg, meta: dict) -> dict:
    """Set the headline keys in an existing ``host_tier.json`` (created if missing); other fields kept."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    for k in HEADLINE_KEYS:
        doc[k] = summary.get(k)
    doc.setdefault("gpu", meta.get("device"))
    doc["concurrency"] = {
        "source": "bench/host_tier_concurrency.py", "command": meta["command"], "device": meta["device"],
        "model": cfg.model_label, "tpot_slo_ms": summary.get("tpot_slo_ms"),
        "tpot_slo_source": summary.get("tpot_slo_source") or summary.get("tpot_slo_reason"),
        "per_server": summary["per_server"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    return doc
