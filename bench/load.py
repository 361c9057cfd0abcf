"""Load driver: end-to-end serving throughput, TTFT and TPOT of each ``--sparse`` mode against ``off``.

    python -m bench.load --modes off,psa,loopserve,lastwindow,samkv --input-lens 4096,16384,32000 \\
        --output-len 256 --concurrency 1,8,32 --device cuda --parallel-servers auto --out DIR

Grid: every (mode, input length, max concurrency) cell; ``off`` (stock ``--sparse off``) is the baseline
of the same run, and every ratio is mode / off of the same cell (throughput: > 1 is better; TTFT, TPOT:
< 1 is better). Each mode runs at its default config unless ``--sparse-config MODE=JSON`` is given.

Clients (``--client``):
- ``fast`` (default): :mod:`bench.load_client`, an in-process threaded streaming client on
  ``/v1/completions`` (token-exact real-prose prompts, ``ignore_eos``, radix cache flushed before every
  cell, one warm-up request per input length per server). No subprocess per cell.
- ``sglang``: ``python -m sglang.benchmark.serving`` once per cell (``--dataset-name random`` over a
  ShareGPT-format JSON written from :mod:`bench.corpus`, so nothing is downloaded).

Servers: ``--parallel-servers N`` starts up to N mode servers at once (ports ``--port``, ``--port``+1, ...)
and benchmarks them strictly one after another (never two cells at once; a started server idles while
another is measured), then stops the group and starts the next. ``--order interleaved`` (the default) runs each
cell on every server of the group back to back, so a slow drift of the machine over the run falls on every mode
alike (measured by mode, a mode benchmarked second ran up to 25 % slower at 4k than the same servers
interleaved); ``--order by-mode`` runs all cells of one server, then the next. On CUDA each server's KV pool is capped
with ``--max-total-tokens`` at what its largest cell needs (max concurrency x (longest input + output)),
and ``--mem-fraction`` is passed as ``--mem-fraction-static``. The cap is what splits the GPU between
servers: SGLang 0.5.17 sizes the pool as (free memory after loading weights) - (free memory before
loading) x (1 - mem_fraction_static), so with several processes a fraction alone does not give each an
equal share (a server that starts after another has allocated sees less free memory). ``auto`` picks the
largest N whose pools and a per-server overhead fit the GPU (nvidia-smi); an N that does not fit is lowered.
An idle SGLang server does no GPU work but its scheduler polls (about 0.7 of a CPU core, measured on the
CPU box): harmless on a 16-core GPU host, but on a 2-core CPU box parallel servers slow each other.

Outputs in ``--out``: ``load_summary.json`` (everything, rewritten after every cell), ``load_report.md``,
``load.png`` and ``e2e_long.json`` (``--e2e-json`` elsewhere): ``{"gpu", "model", "modes": {MODE:
{"<input>_c<conc>": {"throughput_ratio_vs_off", "ttft_ratio_vs_off", "tpot_ratio_vs_off", ...absolute
figures}}}}``. ``--accuracy-json`` (a fidelity_long.json) adds each mode's ``accuracy_ratio_by_length``.
``--rerender DIR`` rebuilds the report and the JSON from ``DIR/load_summary.json`` without servers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import corpus, envinfo
from bench import load_client as lc
from bench.server import Server, ServerSpec, start_group, stop_all
from bench.sparse_configs import parse_mode_configs

REPO = Path(__file__).resolve().parent.parent
METRICS = ("output_throughput", "input_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms", "completed",
           "duration")
RATIOS = (("throughput_ratio_vs_off", "output_throughput"), ("ttft_ratio_vs_off", "mean_ttft_ms"),
          ("median_ttft_ratio_vs_off", "median_ttft_ms"), ("tpot_ratio_vs_off", "mean_tpot_ms"))
SERVER_OVERHEAD_GIB = 3.0   # per server beside its KV pool: weights, CUDA context and graphs, activations
DEFAULT_MEM_FRACTION_PARALLEL = 0.85


def default_model() -> str:
    long = REPO / "models" / "SmolLM2-135M-Instruct-32k"
    return str(long if (long / "config.json").is_file() else REPO / "models" / "SmolLM2-135M-Instruct")


# ------------------------------------------------------------------------------------ sglang's own client

def write_dataset(path: Path, n: int, words: int, seed: int) -> Path:
    """ShareGPT-format prompts made of corpus paragraphs (human turn ~``words`` words)."""
    rng = random.Random(f"load|{seed}")
    rows = [{"conversations": [{"from": "human", "value": "\n\n".join(corpus.haystack(words, rng))},
                               {"from": "gpt", "value": " ".join(corpus.haystack(60, rng))}]} for _ in range(n)]
    path.write_text(json.dumps(rows))
    return path


def bench_cmd(a, dataset: Path, port: int, input_len: int, concurrency: int, out_file: Path) -> list[str]:
    return [a.python, "-m", "bench.serving_entry", "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(port), "--model", a.model, "--tokenizer", a.model, "--dataset-name", "random",
            "--dataset-path", str(dataset), "--random-input-len", str(input_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", str(a.range_ratio),
            "--num-prompts", str(n_prompts(a, concurrency)), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--seed", str(a.seed), "--output-file", str(out_file), "--disable-tqdm"]


def run_sglang_cell(a, out: Path, port: int, input_len: int, concurrency: int, mode_dir: Path, log) -> dict:
    dataset = out / f"load_prompts_{input_len}.json"
    if not dataset.exists():
        write_dataset(dataset, n_prompts(a, max(a.conc)), int(input_len * 0.8) + 50, a.seed)
    stem = lc.cell_key(input_len, concurrency)
    out_file = mode_dir / f"{stem}.jsonl"
    out_file.unlink(missing_ok=True)
    cmd = bench_cmd(a, dataset, port, input_len, concurrency, out_file)
    log(f"[load] {' '.join(shlex.quote(c) for c in cmd)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(mode_dir / f"{stem}.log", "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=a.bench_timeout, env=env)
    if r.returncode != 0 or not out_file.exists():
        tail = "\n".join((mode_dir / f"{stem}.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"bench_serving exited {r.returncode} at {stem}:\n{tail}")
    res = json.loads(out_file.read_text().strip().splitlines()[-1])
    return {k: res.get(k) for k in METRICS}


# ------------------------------------------------------------------------------------------- planning

def n_prompts(a, concurrency: int) -> int:
    return max(a.min_prompts, a.prompts_per_concurrency * concurrency)


def context_length(model: str, server_args: list[str]) -> int | None:
    for i, tok in enumerate(server_args):
        if tok == "--context-length" and i + 1 < len(server_args):
            return int(server_args[i + 1])
        if tok.startswith("--context-length="):
            return int(tok.split("=", 1)[1])
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return None


def pool_plan(a, server_args: list[str], n_modes: int, log) -> dict:
    """KV pool cap, mem fraction and group size of the run (CUDA); CPU keeps ServerSpec's own bounded pool."""
    need = max(a.conc) * (max(a.input_lens) + a.output_len)
    tokens = a.max_total_tokens if a.max_total_tokens is not None else int(math.ceil(need * 1.02 / 1024) * 1024)
    if any(t == "--max-total-tokens" or t.startswith("--max-total-tokens=") for t in server_args):
        tokens = 0  # the user's own cap wins
    kv_gib = (tokens or need) * lc.kv_bytes_per_token(a.model) / 2**30
    want = n_modes if a.parallel_servers == "auto" else max(1, int(a.parallel_servers))
    frac = a.mem_fraction
    plan = {"kv_tokens_needed_largest_cell": need, "max_total_tokens": tokens or None,
            "kv_gib_per_server": round(kv_gib, 2), "gpu_total_gib": None, "mem_fraction_static": frac,
            "parallel_servers_requested": a.parallel_servers}
    n = want
    if a.device == "cuda":
        total = lc.gpu_total_gib()
        plan["gpu_total_gib"] = None if total is None else round(total, 1)
        if frac is None and want > 1:
            frac = plan["mem_fraction_static"] = DEFAULT_MEM_FRACTION_PARALLEL
        if total is not None:
            def fits(k):  # k footprints in 90% of the GPU, and the last starter's budget still holds its pool
                slack = total * (1 - (frac or 0.9))
                return k * (kv_gib + SERVER_OVERHEAD_GIB) <= 0.9 * total and \
                    total - (k - 1) * (kv_gib + SERVER_OVERHEAD_GIB) - slack >= kv_gib
            while n > 1 and not fits(n):
                n -= 1
            if n < want and a.parallel_servers != "auto":
                log(f"[load] --parallel-servers {want} does not fit {total:.0f} GiB with {kv_gib:.1f} GiB of KV "
                    f"per server: using {n}")
        elif a.parallel_servers == "auto":
            n = 1
    else:  # CPU: ServerSpec's own bounded pool (--max-total-tokens 16384), SGLang's default fraction
        n = min(want, 2) if a.parallel_servers == "auto" else want
        plan.update(max_total_tokens=None, mem_fraction_static=None)
    plan["parallel_servers"] = max(1, min(n, n_modes))
    return plan


def server_extra(a, plan: dict, server_args: list[str]) -> list[str]:
    extra = []
    if a.device == "cuda":
        if plan["mem_fraction_static"] is not None:
            extra += ["--mem-fraction-static", str(plan["mem_fraction_static"])]
        if plan["max_total_tokens"]:
            extra += ["--max-total-tokens", str(plan["max_total_tokens"])]
    return extra + server_args


# ------------------------------------------------------------------------------------------- outputs

def _ratio(x, b):
    return x / b if isinstance(x, (int, float)) and isinstance(b, (int, float)) and b > 0 and x >= 0 else None


def load_accuracy(path: str | None) -> dict:
    if not path:
        return {}
    d = json.loads(Path(path).read_text())
    return {"source": str(path), "modes": {m: v.get("accuracy_ratio_by_length") for m, v in (d.get("modes") or {})
                                           .items() if isinstance(v, dict) and v.get("accuracy_ratio_by_length")}}


def pool_limited(pools: dict, modes, concurrency, input_len, output_len) -> list[str]:
    """The servers among ``modes`` whose KV pool cannot hold the cell's ``concurrency`` requests at once: their
    figures measure queueing for KV memory, not the attention path, so the cell's ratios are left out."""
    if not concurrency or not input_len:
        return []
    need = int(concurrency) * (int(input_len) + int(output_len or 0))
    return [m for m in modes if isinstance(pools.get(m), int) and pools[m] < need]


def e2e_json(summary: dict) -> dict:
    """The ``e2e_long.json`` document: per mode and cell, the ratios vs off plus the absolute figures (no ratios
    where a KV pool was too small for the cell: :func:`pool_limited`)."""
    meta, grid, results = summary["meta"], summary["grid"], summary["results"]
    base = results.get("off", {})
    acc = (summary.get("accuracy") or {}).get("modes") or {}
    pools = {m: s.get("pool_tokens") for m, s in ((summary.get("servers") or {}).get("per_mode") or {}).items()}
    modes = {}
    for m, cells in results.items():
        row = {}
        for key, r in cells.items():
            b = base.get(key) or {}
            limited = pool_limited(pools, (m, "off"), r.get("concurrency"), r.get("input_len"), grid.get("output_len"))
            cell = {name: None if limited else _ratio(r.get(k), b.get(k)) for name, k in RATIOS}
            if limited:
                cell["kv_pool_limited"] = limited
            cell.update({"input_len": r.get("input_len"), "concurrency": r.get("concurrency"),
                         "num_prompts": r.get("num_prompts"), "completed": r.get("completed"),
                         "output_throughput_tok_s": r.get("output_throughput"), "mean_ttft_ms": r.get("mean_ttft_ms"),
                         "median_ttft_ms": r.get("median_ttft_ms"), "mean_tpot_ms": r.get("mean_tpot_ms"),
                         "median_tpot_ms": r.get("median_tpot_ms")})
            row[key] = cell
        if acc.get(m):
            row["accuracy_ratio_by_length"] = acc[m]
        modes[m] = row
    return {"gpu": meta.get("gpu"), "model": Path(meta.get("model", "")).name, "model_path": meta.get("model"),
            "source": "bench/load.py (load_summary.json)", "command": meta.get("command"),
            "date_utc": meta.get("date_utc"), "versions": meta.get("versions"), "client": grid.get("client"),
            "output_len": grid.get("output_len"), "input_lens": grid.get("input_lens"),
            "concurrency": grid.get("concurrency"), "baseline": "off (stock --sparse off), same cell, same run",
            "ratio_definitions": "mode / off of the same cell: throughput > 1 is better; ttft, tpot < 1 is better "
                                 "(ttft = mean TTFT, tpot = mean TPOT)",
            "servers": summary.get("servers"), "accuracy_source": (summary.get("accuracy") or {}).get("source"),
            "modes": modes,
            # the config each server reported (bench.mode_settings labels rows not at today's defaults)
            "mode_configs": {m: s["sparse_config"] for m, s in ((summary.get("servers") or {}).get("per_mode") or {})
                             .items() if s.get("sparse_config")}}


def _fmt(x, nd=1):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _acc_cell(acc: dict | None, input_len: int) -> str:
    if not acc:
        return ""
    for k in (lc.input_label(input_len), str(input_len)):
        if k in acc:
            v = acc[k]
            return _fmt(v, 2) if isinstance(v, (int, float)) else str(v)
    return ""


def write_report(out: Path, summary: dict, e2e_path: Path | None = None, plot: bool = True) -> None:
    meta, grid, results, errors = summary["meta"], summary["grid"], summary["results"], summary["errors"]
    (out / "load_summary.json").write_text(json.dumps(summary, indent=1))
    doc = e2e_json(summary)
    (e2e_path or out / "e2e_long.json").write_text(json.dumps(doc, indent=1) + "\n")
    acc = (summary.get("accuracy") or {}).get("modes") or {}
    md = ["# End-to-end serving load by --sparse mode (bench/load.py)", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()]
    md += [f"- grid: inputs {', '.join(map(str, grid['input_lens']))} tokens, output {grid['output_len']} tokens "
           f"(ignore_eos), max concurrency {', '.join(map(str, grid['concurrency']))}; prompts per cell "
           f"{grid['prompts']}; client `{grid['client']}`", ""]
    srv = summary.get("servers") or {}
    plan = srv.get("plan") or {}
    if plan:
        md += ["## Servers", "",
               f"- groups started together (benchmarked one server at a time, "
               f"{'cell by cell, each server of a group back to back' if grid.get('order', 'by-mode') == 'interleaved' else 'all cells of one server, then the next'}): "
               f"{' | '.join(', '.join(g) for g in srv.get('groups', []))}",
               f"- KV pool per server: {plan.get('max_total_tokens') or 'not capped here (CPU: ServerSpec bounds it)'}"
               f" tokens (largest cell needs "
               f"{plan.get('kv_tokens_needed_largest_cell')} = max concurrency x (longest input + output); "
               f"{plan.get('kv_gib_per_server')} GiB), --mem-fraction-static "
               f"{plan.get('mem_fraction_static') or 'SGLang default'}, GPU {plan.get('gpu_total_gib') or 'n/a'} GiB"]
        md += ["- each server's KV pool is capped with --max-total-tokens at its largest cell's need, so the servers "
               "of a group fit the GPU side by side (SGLang 0.5.17 sizes a pool from the free memory it sees, so a "
               "--mem-fraction-static split alone would not divide the GPU evenly between processes); while one "
               "server is measured the others of its group idle (no GPU work)"] if plan.get("max_total_tokens") else []
        md += [f"- `{m}`: port {s.get('port')}, ready in {_fmt(s.get('startup_s'), 0)} s, KV pool "
               f"{s.get('pool_tokens')} tokens" for m, s in (srv.get("per_mode") or {}).items()]
        md += [""]
    hdr = ["mode", "input", "conc", "done", "out tok/s", "vs off", "mean TTFT ms", "median TTFT ms", "vs off",
           "mean TPOT ms", "vs off"] + (["accuracy ratio (len)"] if acc else [])
    md += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for m, cells in doc["modes"].items():
        for n in grid["input_lens"]:
            for c in grid["concurrency"]:
                key = lc.cell_key(n, c)
                r, x = results.get(m, {}).get(key), cells.get(key)
                if not r:
                    continue
                row = [m, lc.input_label(n), str(c), f"{r.get('completed')}/{r.get('num_prompts', '?')}",
                       _fmt(r.get("output_throughput")),
                       _fmt(x["throughput_ratio_vs_off"], 2) if not x.get("kv_pool_limited")
                       else "n/a (KV pool of " + ", ".join(x["kv_pool_limited"]) + ")",
                       _fmt(r.get("mean_ttft_ms")), _fmt(r.get("median_ttft_ms")), _fmt(x["ttft_ratio_vs_off"], 2),
                       _fmt(r.get("mean_tpot_ms"), 2), _fmt(x["tpot_ratio_vs_off"], 2)]
                md.append("| " + " | ".join(row + ([_acc_cell(acc.get(m), n)] if acc else [])) + " |")
    md += ["", "Ratios are mode / off of the same cell (throughput: > 1 is better; TTFT, TPOT: < 1 is better). "
           "TTFT = first streamed token - request start; TPOT = (last token - first token) / (tokens - 1); "
           "output tok/s = completion tokens of the cell / its wall time. A cell whose concurrency x (input + "
           "output) exceeds the KV pool of the mode or of off has no ratios (`kv_pool_limited` in the JSON): its "
           "requests queue for KV memory."]
    if acc:
        md += ["", f"## Accuracy ratio by length (from `{summary['accuracy']['source']}`)", ""]
        md += [f"- `{m}`: " + ", ".join(f"{k} {_fmt(v, 2) if isinstance(v, (int, float)) else v}"
                                        for k, v in a.items()) for m, a in acc.items()]
    if plot and _plot(out, summary):
        md += ["", "![load](load.png)"]
    if errors:
        md += ["", "## Errors", ""] + [f"- `{m}`: {e}" for m, e in errors.items()]
    (out / "load_report.md").write_text("\n".join(md) + "\n")


def _plot(out: Path, summary: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grid, results = summary["grid"], summary["results"]
    lens = grid["input_lens"]
    fig, axs = plt.subplots(len(lens), 3, figsize=(13, 3.4 * len(lens)), squeeze=False)
    for i, n in enumerate(lens):
        for m, cells in results.items():
            cs = [c for c in grid["concurrency"] if (cells.get(lc.cell_key(n, c)) or {}).get("completed")]
            for ax, k, t in zip(axs[i], ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
                                ("output tokens/s", "mean TTFT (ms)", "mean TPOT (ms)")):
                ax.plot(cs, [cells[lc.cell_key(n, c)][k] for c in cs], marker="o", label=m)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("max concurrency")
                ax.set_title(f"{t}, input {lc.input_label(n)}")
        if axs[i][0].get_legend_handles_labels()[0]:
            axs[i][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=100)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------- driver

def warm_up_server(a, s: Server, maker, summary: dict, log) -> None:
    """Record the server's start-up and pool; one warm-up request per input length (kernels specialised on a length
    compile here, not inside the first cell)."""
    mode, url = s.spec.mode, s.url
    summary["results"].setdefault(mode, {})
    summary["servers"]["per_mode"][mode].update(startup_s=s.startup_s, pool_tokens=lc.server_pool_tokens(url),
                                                sparse_config=lc.server_sparse_config(url))
    if maker is not None:
        for n in sorted(a.input_lens, reverse=True):
            ids = maker.cell_prompts(a.seed + 1000, n, 0, 1)[0]
            w = lc.stream_completion(url, ids, min(a.output_len, 16), a.request_timeout)
            log(f"[load] {mode} warm-up ({len(ids)} tokens): {'ok' if w['ok'] else w['error']}")


def bench_cell(a, s: Server, maker, out: Path, summary: dict, t_start: float, log, n: int, c: int) -> None:
    """One cell (input ``n`` tokens, concurrency ``c``) on one server, unless the time budget is spent."""
    mode, url = s.spec.mode, s.url
    cells = summary["results"].setdefault(mode, {})
    key = lc.cell_key(n, c)
    if a.time_budget and time.monotonic() - t_start > a.time_budget:
        summary["errors"].setdefault(mode, "")
        summary["errors"][mode] += f" {key}: skipped (time budget {a.time_budget:.0f}s);"
        return
    if a.client == "fast":
        if not lc.flush_cache(url):
            log(f"[load] {mode}: /flush_cache refused before {key}")
        prompts = maker.cell_prompts(a.seed, n, c, n_prompts(a, c))
        r = lc.run_cell(url, prompts, a.output_len, c, a.request_timeout)
    else:
        r = run_sglang_cell(a, out, s.spec.port, n, c, out / mode, log)
    r.update(input_len=n, concurrency=c, num_prompts=n_prompts(a, c), output_len=a.output_len)
    cells[key] = r
    if r.get("completed") != r["num_prompts"]:
        summary["errors"][f"{mode} {key}"] = (f"{r.get('completed')}/{r['num_prompts']} requests completed: "
                                              f"{r.get('errors')}")
    log(f"[load] {mode} {key}: {_fmt(r.get('output_throughput'))} out tok/s, TTFT mean "
        f"{_fmt(r.get('mean_ttft_ms'))} ms, TPOT {_fmt(r.get('mean_tpot_ms'), 2)} ms, "
        f"{r.get('completed')}/{n_prompts(a, c)} done")


def bench_group(a, up: list[Server], maker, out: Path, summary: dict, t_start: float, log, flush) -> None:
    """Every cell on every server of a started group. ``--order interleaved`` (default): cell by cell, each server
    back to back, so a drift of the machine over the run (host load, clocks) falls on every mode alike;
    ``by-mode``: all cells of one server, then the next."""
    def guarded(s, fn, *args):
        if s.spec.mode in failed:
            return
        try:
            fn(a, s, maker, *args)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            failed.add(s.spec.mode)
            summary["errors"][s.spec.mode] = f"{type(e).__name__}: {e}"
            log(f"[load] mode {s.spec.mode} FAILED: {summary['errors'][s.spec.mode]}")

    failed: set[str] = set()
    cells = [(n, c) for n in a.input_lens for c in a.conc]
    if a.order == "interleaved":
        for s in up:
            guarded(s, lambda a_, s_, m_: warm_up_server(a_, s_, m_, summary, log))
        for n, c in cells:
            for s in up:
                guarded(s, lambda a_, s_, m_: bench_cell(a_, s_, m_, out, summary, t_start, log, n, c))
            flush()
        return
    for s in up:
        guarded(s, lambda a_, s_, m_: warm_up_server(a_, s_, m_, summary, log))
        for n, c in cells:
            guarded(s, lambda a_, s_, m_: bench_cell(a_, s_, m_, out, summary, t_start, log, n, c))
            flush()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off", help="comma-separated; off is always added first (the baseline); 'stock' "
                   "is plain SGLang without the sglang_sparse plugin")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated max concurrencies")
    p.add_argument("--input-lens", default=None, help="comma-separated input lengths (tokens), e.g. 4096,16384,32000")
    p.add_argument("--input-len", type=int, default=2048, help="one input length (when --input-lens is not given)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--client", choices=["fast", "sglang"], default="fast")
    p.add_argument("--range-ratio", type=float, default=1.0, help="sglang client: 1.0 = fixed lengths")
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--python", default=sys.executable, help="interpreter of the servers")
    p.add_argument("--model", default=default_model())
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=32010, help="first port; a group uses port .. port+N-1")
    p.add_argument("--out", default=None)
    p.add_argument("--e2e-json", default=None, help="where e2e_long.json goes (default OUT/e2e_long.json)")
    p.add_argument("--accuracy-json", default=None, help="a fidelity_long.json: accuracy_ratio_by_length per mode")
    p.add_argument("--rerender", default=None, metavar="DIR", help="rebuild outputs from DIR/load_summary.json")
    p.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON")
    p.add_argument("--server-args", default="",
                   help="extra args for every server, e.g. '--attention-backend flashinfer'")
    p.add_argument("--parallel-servers", default="1", help="servers started at once (N or auto); benched one at a time")
    p.add_argument("--order", choices=["interleaved", "by-mode"], default="interleaved",
                   help="servers started together: run each cell on every one of them back to back (interleaved), "
                        "or all cells of one server before the next (by-mode)")
    p.add_argument("--mem-fraction", type=float, default=None, help="--mem-fraction-static of every CUDA server")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool cap per CUDA server (default: the largest cell's need + 2%%; 0 = no cap)")
    p.add_argument("--server-timeout", type=float, default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=600.0, help="sglang client: seconds per cell")
    p.add_argument("--time-budget", type=float, default=None, help="seconds: cells not started by then are skipped")
    a = p.parse_args(argv)
    a.modes_list = ["off"] + [m.strip() for m in a.modes.split(",") if m.strip() and m.strip() != "off"]
    try:
        a.configs = parse_mode_configs(a.sparse_config)
    except ValueError as e:
        p.error(str(e))
    a.conc = [int(c) for c in a.concurrency.split(",")]
    a.input_lens = [int(x) for x in a.input_lens.split(",")] if a.input_lens else [a.input_len]
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)

    def log(msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    if a.rerender:
        src = Path(a.rerender)
        summary = json.loads((src / "load_summary.json").read_text())
        if a.accuracy_json:
            summary["accuracy"] = load_accuracy(a.accuracy_json)
        out = Path(a.out) if a.out else src
        out.mkdir(parents=True, exist_ok=True)
        write_report(out, summary, Path(a.e2e_json) if a.e2e_json else None)
        log(f"[load] re-rendered {out / 'load_report.md'} and {a.e2e_json or out / 'e2e_long.json'}")
        return 0

    server_args = shlex.split(a.server_args)
    ctx = context_length(a.model, server_args)
    too_long = [n for n in a.input_lens if ctx and n + a.output_len > ctx]
    if too_long:
        print(f"bench.load: input {too_long} + output {a.output_len} exceeds the context length {ctx} of {a.model}",
              file=sys.stderr)
        return 2
    configs = a.configs
    timeout = a.server_timeout or (300.0 if a.device == "cpu" else 900.0)
    out = Path(a.out) if a.out else REPO / "bench" / "results" / "tmp" / f"load-{a.device}"
    out.mkdir(parents=True, exist_ok=True)
    plan = pool_plan(a, server_args, len(a.modes_list), log)
    npar = plan["parallel_servers"]
    groups = [a.modes_list[i:i + npar] for i in range(0, len(a.modes_list), npar)]
    extra = server_extra(a, plan, server_args)
    bg: dict = {}

    def _bg_env():
        bg["env"] = envinfo.collect(a.python, [sys.executable, "-m", "bench.load"] + argv)

    def _bg_prompts():
        bg["maker"] = lc.PromptMaker(a.model) if a.client == "fast" else None
    # the version probe (a subprocess that imports torch) and the tokenizer load overlap the first server starts
    prep = [threading.Thread(target=f, daemon=True) for f in (_bg_env, _bg_prompts)]
    for t in prep:
        t.start()
    meta_more = {"device": a.device, "model": a.model, "dtype": a.dtype, "modes": ", ".join(a.modes_list),
                 "sparse configs": ", ".join(f"{m}={configs[m]}" for m in a.modes_list if m in configs) or
                 "each mode's default (no --sparse-config)", "context length": ctx,
                 "prompts": f"exact-length token ids of {corpus.source_description()}",
                 "extra server args": " ".join(extra) or "(none)"}
    grid = {"modes": a.modes_list, "input_lens": a.input_lens, "concurrency": a.conc, "output_len": a.output_len,
            "client": a.client, "prompts": {str(c): n_prompts(a, c) for c in a.conc}, "order": a.order}
    summary = {"meta": meta_more, "grid": grid,
               "servers": {"plan": plan, "groups": groups, "per_mode": {}},
               "results": {}, "errors": {}, "accuracy": load_accuracy(a.accuracy_json)}
    e2e_path = Path(a.e2e_json) if a.e2e_json else None
    log(f"[load] {len(a.modes_list)} modes in groups {groups}; KV plan {plan}")

    def _sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _sigterm)
    t_start = time.monotonic()
    rc = 0
    for group in groups:
        if a.time_budget and time.monotonic() - t_start > a.time_budget:
            for m in group:
                summary["errors"][m] = f"not started (time budget {a.time_budget:.0f}s)"
            rc = 1
            continue
        servers = []
        for i, mode in enumerate(group):
            (out / mode).mkdir(exist_ok=True)
            spec = ServerSpec(a.python, a.model, a.device, a.port + i, mode, configs.get(mode), a.dtype, extra)
            servers.append(Server(spec, out / mode / "server.log", timeout, log))
            summary["servers"]["per_mode"][mode] = {"port": a.port + i, "group": groups.index(group)}
        try:
            up = start_group(servers, summary["errors"])
            for s in servers:  # a port found taken at start moved (bench.server.Server.start)
                summary["servers"]["per_mode"][s.spec.mode]["port"] = s.spec.port
            if prep:
                for t in prep:
                    t.join()
                prep = []
                summary["meta"] = {**bg.get("env", {}), **meta_more}
                if a.client == "fast" and bg.get("maker") is None:
                    raise RuntimeError("could not load the model's tokenizer for the prompts (see the traceback)")
            maker = bg.get("maker")
            bench_group(a, up, maker, out, summary, t_start, log,
                        lambda: write_report(out, summary, e2e_path, plot=False))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop this group's servers, keep what was measured
            summary["errors"]["interrupted"] = "SIGINT/SIGTERM; later cells not run"
            stop_all(servers)
            rc = 1
            break
        finally:
            stop_all(servers)
        write_report(out, summary, e2e_path, plot=False)
    for t in prep:
        t.join(timeout=120)
    summary["meta"] = {**bg.get("env", {}), **meta_more}
    write_report(out, summary, e2e_path)
    log(f"[load] report: {out / 'load_report.md'}; e2e json: {e2e_path or out / 'e2e_long.json'}")
    return 1 if (rc or summary["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
