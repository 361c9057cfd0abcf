"""Where a decode step's time goes, per ``--sparse`` mode: SGLang's own torch profiler on a served request.

For each mode, one server (``bench.server``), two warm-up requests (a short one; one as long as the measured one, 24
tokens: every sparse kernel compiled), then ``/start_profile`` with
``profile_by_stage`` (SGLang profiles ``--steps`` decode steps on their own and writes
``<out>/<mode>/*-decode.trace.json.gz``), then one long greedy request streamed through
``/v1/chat/completions`` (:func:`bench.host_tier_concurrency.stream_chat`; a user message of ``--prompt-tokens``
words of real prose, ``--max-tokens`` tokens, ``ignore_eos``). The trace is reduced to a small report, so that no trace needs to leave the GPU machine:

  * client side: TTFT and decode tokens/s (inter-token time of the stream);
  * trace side, per profiled decode step: wall time (trace span / steps), GPU kernel time and count,
    the CUDA runtime calls (launches, copies, synchronisations) and the CPU ops that take the most time,
    and the host-sync markers (``aten::item`` / ``aten::_local_scalar_dense``, ``cudaStreamSynchronize``,
    ``cudaDeviceSynchronize``, device-to-host copies (``gpu_memcpy`` events)).

Writes ``<out>/decode_profile.json`` and ``<out>/decode_profile.md``; ``--keep-traces`` keeps the traces.

    # GPU: eager stock vs the sparse modes (all without CUDA graphs, like for like)
    python -m bench.decode_profile --device cuda --modes off,lastwindow,loopserve --out /tmp/dp \\
        --sparse-config 'loopserve={"min_context": 128, "budget": 64}' \\
        --sparse-config 'lastwindow={"min_context": 128, "budget": 128}' \\
        --server-args '--attention-backend flashinfer --page-size 16 --disable-cuda-graph'
    # CPU smoke (tests/test_decode_profile.py)
    python -m bench.decode_profile --device cpu --modes off --prompt-tokens 60 --max-tokens 12 --steps 4 --out /tmp/dp
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import shlex
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.sparse_configs import parse_mode_configs
from bench import corpus, envinfo  # noqa: E402
from bench.host_tier_concurrency import device_name, stream_chat  # noqa: E402
from bench.ab_rounds import sparse_stats  # noqa: E402
from bench.server import Server, ServerSpec  # noqa: E402

# the sparse modes' step counters whose change over the profiled requests the report shows (which decode steps
# replayed which CUDA graph, and how many rows re-selected): a profile mixes steady and selecting steps
STEP_COUNTERS = ("sparse_decode_rows", "graph_decode_steps", "graph_select_steps", "dense_graph_steps", "reselections")


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    """``after - before`` of :data:`STEP_COUNTERS` (those the server reports), or None for a stock server."""
    if not after:
        return None
    before = before or {}
    return {k: after[k] - before.get(k, 0) for k in STEP_COUNTERS if isinstance(after.get(k), (int, float))} or None

SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")


def measure(url: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy streamed request (:func:`bench.host_tier_concurrency.stream_chat`, ``ignore_eos``): TTFT and the
    decode rate (1 / TPOT of the stream)."""
    r = stream_chat(url, [{"role": "user", "content": prompt}], max_tokens, timeout)
    if not r["ok"]:
        raise RuntimeError(f"streamed request failed: {r['error']}")
    return {"ttft_s": r["ttft_s"], "completion_tokens": r["completion_tokens"], "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": int(r.get("cached_tokens") or 0),
            "decode_tok_s": 1.0 / r["tpot_s"] if r["tpot_s"] else None, "text_head": r["text"][:80]}


def _events(trace_path: Path) -> list[dict]:
    with gzip.open(trace_path, "rt") if trace_path.suffix == ".gz" else open(trace_path) as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]


def summarize_trace(trace_path: Path, steps: int, top: int = 12) -> dict:
    """Reduce one decode-stage chrome trace of ``steps`` forward steps to per-step figures (microseconds)."""
    ev = _events(trace_path)
    if not ev:
        raise ValueError(f"{trace_path}: no complete events")
    lo = min(e["ts"] for e in ev)
    hi = max(e["ts"] + e.get("dur", 0) for e in ev)
    by_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    d2h = 0
    for e in ev:
        cat = e.get("cat", "")
        name = e.get("name", "")
        by_cat[cat][name] += e.get("dur", 0)
        counts[cat][name] += 1
        if cat == "gpu_memcpy" and "DtoH" in name:
            d2h += 1
    per = max(steps, 1)

    def table(cat: str) -> list[dict]:
        return [{"name": n, "us_per_step": d / per, "calls_per_step": counts[cat][n] / per}
                for n, d in by_cat[cat].most_common(top)]

    kernel_us = sum(by_cat["kernel"].values())
    runtime_calls = sum(counts["cuda_runtime"].values())
    launches = sum(c for n, c in counts["cuda_runtime"].items() if "Launch" in n or n == "cuLaunchKernel")
    return {
        "trace": trace_path.name, "steps": steps, "wall_us_per_step": (hi - lo) / per,
        "gpu_kernel_us_per_step": kernel_us / per, "kernels_per_step": sum(counts["kernel"].values()) / per,
        "cuda_runtime_calls_per_step": runtime_calls / per, "kernel_launches_per_step": launches / per,
        "host_syncs_per_step": {
            **{n: counts["cuda_runtime"][n] / per for n in SYNC_RUNTIME if counts["cuda_runtime"][n]},
            **{n: counts["cpu_op"][n] / per for n in SYNC_OPS if counts["cpu_op"][n]},
            "device_to_host_copies": d2h / per},
        "top_cpu_ops": table("cpu_op"), "top_cuda_runtime": table("cuda_runtime"), "top_kernels": table("kernel"),
        "top_python": table("python_function"),
    }


def _prompt(words: int, seed: int) -> str:
    return " ".join(corpus.haystack(words, random.Random(seed))) + "\n\nSummarise the text above."


def profile_mode(a, mode: str, sparse_config: str | None, out: Path, log) -> dict:
    mdir = out / mode
    shutil.rmtree(mdir, ignore_errors=True)
    mdir.mkdir(parents=True)
    spec = ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port, mode=mode,
                      sparse_config=sparse_config, extra_args=shlex.split(a.server_args))
    rec: dict = {"mode": mode, "sparse_config": sparse_config, "server": " ".join(spec.argv())}
    with Server(spec, mdir / "server.log", timeout_s=a.server_timeout, log=log) as srv:
        # warm-up: a short request, then one as long as the measured one (another text: no prefix hit) and past
        # generated token 16, so that the sparse modes' prefill, selection and decode kernels are compiled before
        # the measured request (a 40-word prompt stays under a sparse mode's min_context: dense)
        measure(srv.url, _prompt(40, a.seed + 1), 8)
        measure(srv.url, _prompt(a.prompt_tokens, a.seed + 2), min(a.max_tokens, 24))
        runs = [measure(srv.url, _prompt(a.prompt_tokens, a.seed + 10 + i), a.max_tokens) for i in range(a.repeats)]
        rec["unprofiled"] = dict(runs[-1], repeats=len(runs),
                                 ttft_s_mean=statistics.fmean(r["ttft_s"] for r in runs),
                                 ttft_s_median=statistics.median(r["ttft_s"] for r in runs),
                                 ttft_s_runs=[r["ttft_s"] for r in runs],  # each measured request, in order
                                 prompt_tokens_runs=[r["prompt_tokens"] for r in runs],
                                 decode_tok_s_mean=statistics.fmean(r["decode_tok_s"] for r in runs))
        before = sparse_stats(srv.url)
        activities = ["CPU", "GPU"] if a.device == "cuda" else ["CPU"]
        r = requests.post(srv.url + "/start_profile", json={
            "output_dir": str(mdir), "num_steps": a.steps, "activities": activities, "profile_by_stage": True,
            "profile_prefix": mode, "with_stack": False, "record_shapes": False}, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"/start_profile -> HTTP {r.status_code}: {r.text[:300]}")
        # prompts no earlier request shares: the first one's prefill is profiled whole (not a radix prefix hit);
        # --concurrency N sends N of them at once, so the profiled steps decode a batch of N
        with ThreadPoolExecutor(max_workers=a.concurrency) as pool:
            futs = [pool.submit(measure, srv.url, _prompt(a.prompt_tokens, a.seed + 100 * j), a.max_tokens)
                    for j in range(a.concurrency)]
            got = [f.result() for f in futs]
        rec["profiled"] = dict(got[0], concurrency=a.concurrency)
        rec["step_counters"] = counter_delta(before, sparse_stats(srv.url))
        deadline = time.time() + 120
        while "trace" not in rec:  # the scheduler writes the trace after the last profiled step
            traces = sorted(p for p in mdir.glob("*.trace.json*") if "decode" in p.name.lower())
            try:
                if traces:
                    rec["trace"] = summarize_trace(traces[-1], a.steps)
            except (EOFError, OSError, ValueError):  # still being written
                pass
            if "trace" in rec:  # the request's prefill batches (their trace is flushed when decoding starts)
                pre = sorted(p for p in mdir.glob("*.trace.json*") if "extend" in p.name.lower()
                             or "prefill" in p.name.lower())
                rec["prefill_trace"] = summarize_trace(pre[-1], 1) if pre else None
            if "trace" not in rec:
                if time.time() > deadline:
                    raise RuntimeError(f"{mode}: no readable decode trace in {mdir} "
                                       f"(files: {[p.name for p in mdir.iterdir()]})")
                time.sleep(1)
    if not a.keep_traces:
        for t in mdir.glob("*.trace.json*"):
            t.unlink()
    return rec


def write_report(out: Path, results: list[dict], meta: dict) -> None:
    (out / "decode_profile.json").write_text(json.dumps({"meta": meta, "modes": results}, indent=1))
    lines = ["# Decode step profile per mode", "", f"- command: `{meta['command']}`", f"- device: {meta['device']}",
             f"- versions: {meta.get('versions')}",
             f"- request: {meta['prompt_words']} words of prose + a question, {meta['max_tokens']} tokens, greedy, "
             f"ignore_eos; SGLang's torch profiler over {meta['steps']} decode steps (profile_by_stage) of "
             f"{meta.get('concurrency', 1)} such requests decoding together", "",
             "| mode | TTFT ms mean / median (unprofiled) | decode tok/s (unprofiled) | wall us/step (profiled) | "
             "GPU kernel us/step | kernels/step | launches/step | CUDA runtime calls/step | host syncs/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | error: {r['error'][:120]} | | | | | | | |")
            continue
        t = r["trace"]
        u = r["unprofiled"]
        tps = u.get("decode_tok_s_mean", u["decode_tok_s"])
        ttft = f"{1e3 * u.get('ttft_s_mean', u['ttft_s']):.1f} / {1e3 * u.get('ttft_s_median', u['ttft_s']):.1f}"
        lines.append(f"| {r['mode']} | {ttft} | {tps:.1f} | {t['wall_us_per_step']:.0f} | {t['gpu_kernel_us_per_step']:.0f} | "
                     f"{t['kernels_per_step']:.0f} | {t['kernel_launches_per_step']:.0f} | "
                     f"{t['cuda_runtime_calls_per_step']:.0f} | {json.dumps(t['host_syncs_per_step'])} |")
    for r in results:
        if "error" in r:
            continue
        t = r["trace"]
        lines += ["", f"## {r['mode']}", "", f"server: `{r['server']}`", ""]
        pt = r.get("prefill_trace")
        if pt:
            lines += [f"Prefill of the profiled request (all its prefill batches): wall {pt['wall_us_per_step']:.0f} us, "
                      f"GPU kernels {pt['gpu_kernel_us_per_step']:.0f} us in {pt['kernels_per_step']:.0f} kernels, "
                      f"{pt['kernel_launches_per_step']:.0f} launches, host syncs {json.dumps(pt['host_syncs_per_step'])}.",
                      ""]
            for key, title in (("top_kernels", "prefill GPU kernels"), ("top_cuda_runtime", "prefill CUDA runtime"),
                               ("top_cpu_ops", "prefill CPU ops (inclusive)")):
                lines += [f"{title}:", "", "| name | us | calls |", "|---|---|---|"]
                lines += [f"| `{x['name'][:90]}` | {x['us_per_step']:.1f} | {x['calls_per_step']:.0f} |" for x in pt[key]]
                lines.append("")
        lines.append("Decode steps:")
        lines.append("")
        if r.get("step_counters"):
            lines += ["Over the profiled requests (the profiled steps are their first ones): "
                      + ", ".join(f"{k} {v:g}" for k, v in r["step_counters"].items()) + ".", ""]
        for key, title in (("top_cpu_ops", "CPU ops (inclusive)"), ("top_cuda_runtime", "CUDA runtime"),
                           ("top_kernels", "GPU kernels"), ("top_python", "Python functions")):
            if not t[key]:
                continue
            lines += [f"{title}:", "", "| name | us/step | calls/step |", "|---|---|---|"]
            lines += [f"| `{x['name'][:90]}` | {x['us_per_step']:.1f} | {x['calls_per_step']:.1f} |" for x in t[key]]
            lines.append("")
    (out / "decode_profile.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="off,lastwindow,loopserve")
    ap.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--port", type=int, default=30410)
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="words of prose in the prompt (~1.3 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=48, help="decode steps profiled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests decoding together in the profiled steps (each a fresh prompt)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="unprofiled requests measured per mode (fresh prompts; TTFT mean and median)")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--keep-traces", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for name, v in (("--prompt-tokens", a.prompt_tokens), ("--max-tokens", a.max_tokens), ("--steps", a.steps),
                    ("--repeats", a.repeats), ("--concurrency", a.concurrency)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    if a.steps >= a.max_tokens:
        ap.error(f"--steps ({a.steps}) must be below --max-tokens ({a.max_tokens}): the profiled steps must all decode")
    try:
        configs = parse_mode_configs(a.sparse_config)
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [decode_profile] {msg}", flush=True)

    device = device_name(a.device)
    meta = {"command": " ".join(shlex.quote(x) for x in [sys.executable, "-m", "bench.decode_profile",
                                                          *(argv if argv is not None else sys.argv[1:])]),
            "device": device, "versions": envinfo.collect(a.python)["versions"], "prompt_words": a.prompt_tokens, "max_tokens": a.max_tokens, "steps": a.steps,
            "concurrency": a.concurrency}
    results = []
    for mode in [m for m in a.modes.split(",") if m]:
        log(f"== {mode}")
        try:
            rec = profile_mode(a, mode, configs.get(mode), out, log)
            log(f"{mode}: {rec['unprofiled']['decode_tok_s']:.1f} tok/s unprofiled, "
                f"{rec['trace']['wall_us_per_step']:.0f} us/step profiled")
        except Exception as exc:  # recorded, the other modes still run
            rec = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
            log(f"{mode}: {rec['error']}")
        results.append(rec)
        write_report(out, results, meta)
    log(f"report: {out / 'decode_profile.md'}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
