"""Load driver: SGLang's own serving benchmark against each ``--sparse`` mode.

    python -m bench.load --modes off,psa --concurrency 1,8,32 --input-len 2048 --output-len 128

For every mode (``off`` first, as the baseline of the same run) the driver starts a
server, runs ``python -m sglang.benchmark.serving`` once per concurrency, stops the
server, and writes ``load_report.md``, ``load.png`` and ``load_summary.json`` with
throughput, TTFT and TPOT side by side and as ratios to ``off``.

Offline by construction: ``--dataset-name random`` with ``--dataset-path`` pointing at a
ShareGPT-format JSON that this driver writes from the real-prose corpus
(:mod:`bench.corpus`), so SGLang samples real text and never downloads ShareGPT
(it only downloads when the path is not a valid JSON file); ``HF_HUB_OFFLINE=1`` is set
for good measure. The tokenizer is read from the local model folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import corpus, envinfo
from bench.server import Server, ServerError, ServerSpec

REPO = Path(__file__).resolve().parent.parent
METRICS = ("output_throughput", "input_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms", "completed",
           "duration")


def write_dataset(path: Path, n: int, words: int, seed: int) -> Path:
    """ShareGPT-format prompts made of corpus paragraphs (human turn ~``words`` words)."""
    rng = random.Random(f"load|{seed}")
    rows = [{"conversations": [{"from": "human", "value": "\n\n".join(corpus.haystack(words, rng))},
                               {"from": "gpt", "value": " ".join(corpus.haystack(60, rng))}]} for _ in range(n)]
    path.write_text(json.dumps(rows))
    return path


def bench_cmd(a, dataset: Path, concurrency: int, out_file: Path) -> list[str]:
    n = max(a.min_prompts, a.prompts_per_concurrency * concurrency)
    return [a.python, "-m", "bench.serving_entry", "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(a.port), "--model", a.model, "--tokenizer", a.model, "--dataset-name", "random",
            "--dataset-path", str(dataset), "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", str(a.range_ratio),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(a.seed), "--output-file", str(out_file), "--disable-tqdm"]


def run_one(a, dataset: Path, concurrency: int, out_dir: Path, log) -> dict:
    out_file = out_dir / f"c{concurrency}.jsonl"
    out_file.unlink(missing_ok=True)
    cmd = bench_cmd(a, dataset, concurrency, out_file)
    log(f"[load] {' '.join(shlex.quote(c) for c in cmd)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(out_dir / f"c{concurrency}.log", "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=a.bench_timeout, env=env)
    if r.returncode != 0 or not out_file.exists():
        tail = "\n".join((out_dir / f"c{concurrency}.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"bench_serving exited {r.returncode} at concurrency {concurrency}:\n{tail}")
    res = json.loads(out_file.read_text().strip().splitlines()[-1])
    return {k: res.get(k) for k in METRICS}


def _fmt(x, nd=1):
    return "n/a" if x is None else f"{x:.{nd}f}"


def write_report(out: Path, results: dict, meta: dict, errors: dict, conc: list[int]) -> None:
    md = ["# Serving load benchmark (sglang.benchmark.serving) by --sparse mode", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    hdr = ["mode", "concurrency", "completed", "out tok/s", "vs off", "mean TTFT ms", "vs off", "p99 TTFT ms",
           "mean TPOT ms", "vs off", "p99 TPOT ms"]
    md += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    base = results.get("off", {})
    for m, per in results.items():
        for c in conc:
            r, b = per.get(c), base.get(c)
            if not r:
                continue

            def ratio(k):
                return _fmt(r[k] / b[k], 2) if b and b.get(k) and r.get(k) is not None else "n/a"
            md.append(f"| {m} | {c} | {r['completed']} | {_fmt(r['output_throughput'])} | {ratio('output_throughput')} "
                      f"| {_fmt(r['mean_ttft_ms'])} | {ratio('mean_ttft_ms')} | {_fmt(r['p99_ttft_ms'])} "
                      f"| {_fmt(r['mean_tpot_ms'], 2)} | {ratio('mean_tpot_ms')} | {_fmt(r['p99_tpot_ms'], 2)} |")
    md += ["", "![load](load.png)"]
    if errors:
        md += ["", "## Errors", ""] + [f"- `{m}`: {e}" for m, e in errors.items()]
    (out / "load_report.md").write_text("\n".join(md) + "\n")
    (out / "load_summary.json").write_text(json.dumps({"meta": meta, "results": results, "errors": errors},
                                                      indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(1, 3, figsize=(13, 3.8))
    for m, per in results.items():
        cs = [c for c in conc if per.get(c)]
        for ax, k, t in zip(axs, ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
                            ("output tokens/s", "mean TTFT (ms)", "mean TPOT (ms)")):
            ax.plot(cs, [per[c][k] for c in cs], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_title(t)
    axs[0].legend()
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated max concurrencies")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=1.0, help="1.0 = fixed lengths")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=32010)
    p.add_argument("--out", default=None)
    p.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON")
    p.add_argument("--server-args", default="")
    p.add_argument("--server-timeout", type=float, default=None)
    p.add_argument("--bench-timeout", type=float, default=600.0, help="seconds per bench_serving run")
    a = p.parse_args(argv)
    modes = ["off"] + [m.strip() for m in a.modes.split(",") if m.strip() and m.strip() != "off"]
    conc = [int(c) for c in a.concurrency.split(",")]
    configs = dict(item.split("=", 1) for item in a.sparse_config)
    timeout = a.server_timeout or (300.0 if a.device == "cpu" else 900.0)
    out = Path(a.out) if a.out else REPO / "bench" / "results" / "tmp" / f"load-{a.device}"
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    n_max = max(a.min_prompts, a.prompts_per_concurrency * max(conc))
    dataset = write_dataset(out / "load_prompts.json", n_max, int(a.input_len * 0.8) + 50, a.seed)
    meta = envinfo.collect(a.python, [sys.executable, "-m", "bench.load"] + (argv or sys.argv[1:]))
    meta.update({"device": a.device, "model": a.model, "dtype": a.dtype, "modes": ", ".join(modes),
                 "workload": f"input {a.input_len} tok, output {a.output_len} tok (range ratio {a.range_ratio}), "
                             f"{a.prompts_per_concurrency} prompts per unit of concurrency (min {a.min_prompts}), "
                             f"request rate inf, dataset 'random' over {corpus.source_description()}",
                 "extra server args": a.server_args or "(none)"})
    results: dict = {}
    errors: dict = {}

    def _sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _sigterm)
    for mode in modes:
        spec = ServerSpec(a.python, a.model, a.device, a.port, mode, configs.get(mode), a.dtype,
                          shlex.split(a.server_args))
        (out / mode).mkdir(exist_ok=True)
        results[mode] = {}
        try:
            with Server(spec, out / mode / "server.log", timeout, log):
                for c in conc:
                    results[mode][c] = run_one(a, dataset, c, out / mode, log)
                    r = results[mode][c]
                    log(f"[load] {mode} c={c}: {r['output_throughput']:.1f} out tok/s, TTFT {r['mean_ttft_ms']:.1f} ms,"
                        f" TPOT {r['mean_tpot_ms']:.2f} ms")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the server was stopped by the context manager
            errors[mode] = "interrupted (SIGINT/SIGTERM); later modes not run"
            write_report(out, results, meta, errors, conc)
            break
        except (ServerError, RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            errors[mode] = f"{type(e).__name__}: {e}"
            log(f"[load] mode {mode} FAILED: {errors[mode]}")
        write_report(out, results, meta, errors, conc)
    log(f"[load] report: {out / 'load_report.md'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
