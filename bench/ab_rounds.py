"""Repeated, interleaved A/B of servers on one GPU: small throughput gaps measured against their own noise.

    python -m bench.ab_rounds --model /tmp/models/SmolLM2-135M-Instruct --device cuda \\
        --servers 'off,off2=off,psa,loopserve' --input-len 4096 --output-len 256 --concurrency 1,8 \\
        --rounds 5 --server-args '--attention-backend flashinfer' --out DIR

Every server of ``--servers`` (``LABEL=MODE[:JSON]`` or ``MODE``, as in :mod:`bench.loopserve_turns`) is started
at once, each with a capped KV pool (``--max-total-tokens``), and stays up for the whole run (with
``--restart-each-round``: a fresh set of servers for every round, since a server process can stay faster or slower
than an identical one for its whole life, which rotating the order does not average out). A round runs every
cell (input length x concurrency, :mod:`bench.load_client`: token-exact prose prompts, ``ignore_eos``, radix cache
flushed first) on every server back to back, the server order rotating by one each round, so a drift of the
machine falls on every server alike. Two or more ``off`` servers give the noise floor: identical stock servers
differ by as much as the machine's noise.

Per server and cell the report gives each round's output throughput and its ratio to the mean of the baseline
servers (every server of mode ``off``; the first server when there is none) in the same round, the geometric mean
of those ratios with their min and max, and the median TPOT and TTFT. ``--pythonpath LABEL=DIR`` starts one server
with ``DIR`` first on its ``PYTHONPATH`` (another checkout of the project: an A/B of two code versions on one
machine); ``--url LABEL=URL`` uses a server that is already running (not started, not stopped). Each server's
sglang-sparse counters (``/server_info``) are read at the end of the run (``sparse_stats``; the last round's
servers when they restart). Outputs in
``--out``: ``ab_rounds.json`` and ``ab_rounds.md``; server logs beside them. Servers started here are stopped by
their own process group.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from bench import envinfo
from bench import load_client as lc
from bench.loopserve_turns import parse_configs
from bench.server import Server, ServerSpec, cpu_groups, start_group, stop_all


def parse_labelled(flag: str, items: list[str], labels: list[str], value: Callable[[str], str | None],
                   expected: str) -> dict[str, str]:
    """``LABEL=VALUE`` items of ``--flag`` -> ``{label: value(VALUE)}``; a label must be one of ``labels``;
    ``value`` returns None for a VALUE it refuses (``expected`` says what was expected)."""
    out = {}
    for item in items:
        label, sep, raw = item.partition("=")
        got = value(raw) if sep and label and raw else None
        if got is None:
            raise ValueError(f"--{flag} '{item}': expected LABEL={expected}")
        if label not in labels:
            raise ValueError(f"--{flag} '{item}': no server is labelled '{label}' (servers: {', '.join(labels)})")
        out[label] = got
    return out


def parse_pythonpaths(items: list[str], labels: list[str]) -> dict[str, str]:
    """``LABEL=DIR`` items -> ``{label: absolute dir}`` (DIR an existing folder)."""
    return parse_labelled("pythonpath", items, labels, lambda p: str(Path(p).resolve()) if Path(p).is_dir() else None,
                          "DIR (an existing folder)")


def parse_urls(items: list[str], labels: list[str]) -> dict[str, str]:
    """``LABEL=URL`` items -> ``{label: url}`` (servers already running)."""
    return parse_labelled("url", items, labels,
                          lambda u: u.rstrip("/") if u.startswith(("http://", "https://")) else None,
                          "http://HOST:PORT")


class _Running:
    """A server given by ``--url``: used as is, never started or stopped here."""

    def __init__(self, url: str):
        self.url = url


def sparse_section(url: str, key: str, timeout: float = 30.0) -> dict | None:
    """One field of the server's sglang-sparse report (``/server_info`` -> ``internal_states[0].sparse[key]``), or
    None (a stock server, a dormant mode's counters, or no answer)."""
    import requests

    try:
        r = requests.get(url + "/server_info", timeout=timeout)
        r.raise_for_status()
        states = r.json().get("internal_states") or [{}]
        got = (states[0].get("sparse") or {}).get(key)
    except (requests.RequestException, ValueError, AttributeError, IndexError):
        return None
    return got if isinstance(got, dict) and got else None


def sparse_stats(url: str, timeout: float = 30.0) -> dict | None:
    """The server's sglang-sparse counters since start-up (``stats``), or None: what each mode did over the run
    (e.g. psa's sparse and switched rows)."""
    return sparse_section(url, "stats", timeout)


def rotated(labels: list[str], r: int) -> list[str]:
    """Server order of round ``r``: the list rotated left by ``r``."""
    k = r % len(labels) if labels else 0
    return labels[k:] + labels[:k]


def summarize(raw: dict[str, dict[str, list[dict]]], baseline: list[str]) -> dict:
    """Per server and cell: throughput per round, ratio per round to the baseline servers' mean of that round,
    their geometric mean / min / max, median TPOT and TTFT. ``raw[label][cell]`` lists the rounds' cell dicts
    (:func:`bench.load_client.summarize`)."""
    out: dict[str, dict] = {}
    for label, cells in raw.items():
        out[label] = {}
        for cell, rounds in cells.items():
            tput = [r.get("output_throughput") for r in rounds]
            base = []
            for i in range(len(rounds)):
                vals = [raw[b][cell][i].get("output_throughput") for b in baseline if i < len(raw[b][cell])]
                vals = [v for v in vals if v]
                base.append(statistics.fmean(vals) if vals else None)
            ratios = [t / b for t, b in zip(tput, base) if t and b]
            tpot = [r["median_tpot_ms"] for r in rounds if r.get("median_tpot_ms") is not None]
            ttft = [r["median_ttft_ms"] for r in rounds if r.get("median_ttft_ms") is not None]
            out[label][cell] = {
                "throughput_per_round": [None if t is None else round(t, 1) for t in tput],
                "ratio_per_round": [round(x, 4) for x in ratios],
                "ratio_geomean": round(statistics.geometric_mean(ratios), 4) if ratios else None,
                "ratio_min": round(min(ratios), 4) if ratios else None,
                "ratio_max": round(max(ratios), 4) if ratios else None,
                "median_tpot_ms": round(statistics.median(tpot), 3) if tpot else None,
                "median_ttft_ms": round(statistics.median(ttft), 2) if ttft else None,
                "failed": sum(int(r.get("failed") or 0) for r in rounds),
            }
    return out


def render_md(report: dict) -> str:
    meta, summ = report["meta"], report["summary"]
    cells = list(next(iter(summ.values())).keys()) if summ else []
    lines = [f"# Interleaved A/B: {meta['rounds']} rounds", "",
             f"GPU: {meta.get('gpu')}. Command: `{meta['command']}`.", "",
             f"Baseline of each round: the mean of {', '.join(meta['baseline'])}. Ratio: output throughput / "
             "baseline (> 1 is faster); geometric mean over the rounds [min, max]."
             + (" Every round ran on freshly started servers (`--restart-each-round`)."
                if meta.get("restart_each_round") else ""), "",
             "| server | " + " | ".join(f"{c} ratio [min, max]" for c in cells) + " | "
             + " | ".join(f"{c} TPOT ms" for c in cells) + " |",
             "|---|" + "---|" * (2 * len(cells))]
    for label, row in summ.items():
        def fmt(c):
            x = row[c]
            return "-" if x["ratio_geomean"] is None else \
                f"{x['ratio_geomean']:.3f} [{x['ratio_min']:.2f}, {x['ratio_max']:.2f}]"
        lines.append(f"| {label} | " + " | ".join(fmt(c) for c in cells) + " | "
                     + " | ".join(f"{row[c]['median_tpot_ms']}" for c in cells) + " |")
    lines += ["", "Servers:", ""]
    for s in meta["servers"]:
        st = (report.get("sparse_stats") or {}).get(s["label"])
        eng = (report.get("sparse_engagement") or {}).get(s["label"]) or {}
        keys = [k for k in _STAT_KEYS if st and st.get(k) is not None]
        lines.append(f"- `{s['label']}`: `--sparse {s['mode']}`" + (f" `--sparse-config '{s['config']}'`"
                                                                    if s["config"] else "")
                     + (f", code from `{s['pythonpath']}`" if s.get("pythonpath") else "")
                     + (f", on CPUs {','.join(map(str, s['cpus']))}" if s.get("cpus") else "")
                     + (f"; dormant (min_context {eng.get('min_context')} above the longest sequence "
                        f"{eng.get('longest_sequence')}: the stock server)" if eng.get("dormant") else "")
                     + ("; over the run (warm-up included): " + ", ".join(f"{k} {_fmt_stat(st[k])}" for k in keys)
                        if keys else ""))
    return "\n".join(lines) + "\n"


# counters of /server_info shown in the report when a server has them (psa's switch; loopserve's engagement)
_STAT_KEYS = ("sparse_rows", "switched_dense_rows", "probe_rows", "prefill_probes", "probe_read_fraction",
              "read_fraction", "sparse_decode_steps", "dense_decode_steps", "dense_graph_steps", "graph_decode_steps")


def _fmt_stat(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", required=True, help="LABEL=MODE[:JSON] or MODE items, comma-separated")
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", default="1,8", help="comma-separated max concurrencies")
    p.add_argument("--prompts-per-concurrency", type=int, default=3, help="prompts of a cell = this x concurrency")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=31000, help="first port; server i listens on port + i")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool cap per server (CUDA; default: the largest cell's need)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="--mem-fraction-static of each server (CUDA)")
    p.add_argument("--server-args", default="", help="extra arguments for every server")
    p.add_argument("--pythonpath", action="append", default=[], metavar="LABEL=DIR",
                   help="start server LABEL with DIR first on its PYTHONPATH (repeatable)")
    p.add_argument("--url", action="append", default=[], metavar="LABEL=URL",
                   help="server LABEL is already running at URL: not started, not stopped (repeatable)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="run each started server on its own equal set of physical cores, and this client on one "
                        "more (without it the OS places processes freely, and a server that shares cores with "
                        "another stays slower or faster for the whole run, which rounds do not average out)")
    p.add_argument("--restart-each-round", action="store_true",
                   help="start the servers afresh for every round and stop them after it (server logs "
                        "server_LABEL_rN.log): a server process that is steadily faster or slower than an identical "
                        "one then counts once per round instead of for the whole run")
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        a.items = parse_configs(a.servers)
        a.conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
        labels = [lab for lab, _, _ in a.items]
        a.paths = parse_pythonpaths(a.pythonpath, labels)
        a.urls = parse_urls(a.url, labels)
        if set(a.paths) & set(a.urls):
            raise ValueError(f"--pythonpath and --url both name {', '.join(sorted(set(a.paths) & set(a.urls)))}: "
                             "a running server's code is already chosen")
    except ValueError as e:
        p.error(str(e).replace("--configs", "--servers"))
    if not a.conc or min(a.conc) < 1:
        p.error(f"--concurrency must list integers >= 1, got '{a.concurrency}'")
    for name in ("rounds", "input_len", "output_len", "prompts_per_concurrency", "min_prompts"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def _spec(a, i: int, label: str, mode: str, cfg: str | None, cpus=None) -> ServerSpec:
    extra = a.server_args.split()
    if a.device == "cuda":
        need = max(a.conc) * (a.input_len + a.output_len)
        tokens = a.max_total_tokens or int(-(-need * 1.02 // 1024) * 1024)
        extra = ["--mem-fraction-static", str(a.mem_fraction), "--max-total-tokens", str(tokens)] + extra
    env = {}
    if label in a.paths:
        old = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = a.paths[label] + (os.pathsep + old if old else "")
    return ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port + i, mode=mode,
                      sparse_config=cfg, extra_args=extra, env=env, cpus=cpus)


def pin_plan(a, log) -> dict[str, tuple[int, ...]]:
    """With ``--pin-cpus``: CPUs per started server (:func:`bench.server.cpu_groups`), and this process moved onto
    the client's core; ``{}`` without it. Refuses (SystemExit) when the machine has too few cores."""
    if not a.pin_cpus:
        return {}
    started = [lab for lab, _, _ in a.items if lab not in a.urls]
    try:
        client, groups = cpu_groups(len(started), reserve=1)
    except ValueError as e:
        raise SystemExit(f"error: --pin-cpus: {e}")
    os.sched_setaffinity(0, client)
    pins = dict(zip(started, groups))
    log("CPUs: client " + ",".join(map(str, client)) + "; "
        + "; ".join(f"{lab} {','.join(map(str, g))}" for lab, g in pins.items()))
    return pins


def _make_servers(a, out: Path, pins: dict, log, suffix: str = "") -> dict:
    """LABEL -> :class:`Server` to start (log ``server_LABEL{suffix}.log``) or :class:`_Running` (``--url``)."""
    return {lab: _Running(a.urls[lab]) if lab in a.urls else
            Server(_spec(a, i, lab, mode, cfg, pins.get(lab)), out / f"server_{lab}{suffix}.log",
                   timeout_s=a.server_timeout, log=log)
            for i, (lab, mode, cfg) in enumerate(a.items)}


class StartFailed(RuntimeError):
    """A server of the run did not come up (each failure is logged)."""


def _start(servers: dict, log) -> list[Server]:
    """Start the servers to start, all at once; returns them. Raises :class:`StartFailed` naming each server that
    failed, after stopping the others."""
    launch = [s for s in servers.values() if isinstance(s, Server)]
    label_of = {id(s): lab for lab, s in servers.items()}
    errors: dict[str, str] = {}
    start_group(launch, errors, key=lambda s: label_of[id(s)])
    if errors:
        for lab, e in errors.items():
            log(f"server {lab} failed: {e}")
        stop_all(launch)
        raise StartFailed("servers failed to start: " + ", ".join(sorted(errors)))
    return launch


def _round(a, r: int, servers: dict, cells: dict, raw: dict, log) -> None:
    """Round ``r``: every cell on every server back to back, the server order rotated by ``r``."""
    labels = [lab for lab, _, _ in a.items]
    for c in a.conc:
        for lab in rotated(labels, r):
            url = servers[lab].url
            lc.flush_cache(url)
            s = lc.run_cell(url, cells[c], a.output_len, c, a.request_timeout)
            raw[lab][f"c{c}"].append(s)
            log(f"round {r + 1}/{a.rounds} c{c} {lab}: {s['output_throughput'] or 0:.0f} tok/s, "
                f"TPOT {s['median_tpot_ms'] or 0:.2f} ms, failed {s['failed']}")


def _warm(a, servers: dict, cells: dict) -> None:
    for s in servers.values():  # warm-up, not counted
        lc.run_cell(s.url, cells[a.conc[0]][:1], 16, 1, a.request_timeout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(msg):
        print(f"[ab +{time.monotonic() - t0:.0f}s] {msg}", flush=True)

    labels = [lab for lab, _, _ in a.items]
    pins = pin_plan(a, log)
    maker = lc.PromptMaker(a.model)
    cells = {c: maker.cell_prompts(a.seed, a.input_len, c, max(a.min_prompts, a.prompts_per_concurrency * c))
             for c in a.conc}
    raw = {lab: {f"c{c}": [] for c in a.conc} for lab in labels}
    launch: list[Server] = []
    try:
        # one server set for the run, or a fresh one per round (--restart-each-round)
        for r in range(a.rounds):
            if r == 0 or a.restart_each_round:
                stop_all(launch)
                servers = _make_servers(a, out, pins, log, f"_r{r + 1}" if a.restart_each_round else "")
                launch = _start(servers, log)
                _warm(a, servers, cells)
            _round(a, r, servers, cells, raw, log)
        stats = {lab: sparse_stats(servers[lab].url) for lab in labels}
        engaged = {lab: sparse_section(servers[lab].url, "engagement") for lab in labels}
        baseline = [lab for lab, mode, _ in a.items if mode == "off"] or labels[:1]
        env = envinfo.collect(a.python, [sys.executable, "-m", "bench.ab_rounds"] + argv)
        report = {"meta": {"command": "python -m bench.ab_rounds " + shlex.join(argv), "gpu": env.get("gpu"),
                           "versions": env, "rounds": a.rounds, "input_len": a.input_len,
                           "output_len": a.output_len, "concurrency": a.conc, "baseline": baseline,
                           "restart_each_round": a.restart_each_round,
                           "prompts": {f"c{c}": len(cells[c]) for c in a.conc},
                           "servers": [{"label": lab, "mode": mode, "config": cfg, "pythonpath": a.paths.get(lab),
                                        "url": a.urls.get(lab), "cpus": list(pins[lab]) if lab in pins else None}
                                       for lab, mode, cfg in a.items]},
                  "summary": summarize(raw, baseline), "sparse_stats": stats,
                  "sparse_engagement": engaged, "raw": raw}
        (out / "ab_rounds.json").write_text(json.dumps(report, indent=1))
        (out / "ab_rounds.md").write_text(render_md(report))
        log(f"wrote {out / 'ab_rounds.json'} and ab_rounds.md")
        print(render_md(report))
        return 0
    except StartFailed as e:
        log(str(e))
        return 1
    finally:
        stop_all(launch)


if __name__ == "__main__":
    sys.exit(main())
