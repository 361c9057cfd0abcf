"""Driver: run the offline multi-turn benchmark against one server per ``--sparse`` mode.

    python -m bench.run_harness --modes off,loopserve --preset tiny --device cpu

``off`` is always run first, in the same invocation, as the baseline. For every mode
the driver starts ``python -m sglang.launch_server`` (CPU or GPU), plays every task
through ``/v1/chat/completions`` as a real conversation, runs the fidelity probes on
``/generate``, stops the server, and rewrites the report, so a failed mode still leaves
the others' results. Output directory: report.md, accuracy_by_position.png,
latency.png, summary.json, raw/<mode>.json, logs/<mode>.log and baseline_dense.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from bench.sparse_configs import parse_mode_configs
from bench import envinfo, harness, report, tasks
from bench.server import Server, ServerError, ServerSpec

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off", help="comma-separated --sparse modes; 'off' is always added first; 'stock' is plain SGLang "
                        "without the sglang_sparse plugin")
    p.add_argument("--preset", default="tiny", choices=sorted(tasks.PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--python", default=sys.executable, help="interpreter that has sglang (server side)")
    p.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=32000)
    p.add_argument("--out", default=None, help="output dir (default bench/results/tmp/<preset>-<device>)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="conversations in flight at once (default 1 on cpu, 8 on cuda); fidelity probes "
                        "always run one at a time")
    p.add_argument("--fidelity-probes", type=int, default=None, metavar="N",
                   help="run the first N of the preset's fidelity probes (default: all of them; 0: none)")
    p.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON",
                   help="per-mode --sparse-config, e.g. loopserve='{\"alpha\":0.98}' (repeatable)")
    p.add_argument("--server-timeout", type=float, default=None,
                   help="seconds to wait for a server to be ready (default 300 cpu / 900 cuda)")
    p.add_argument("--server-args", default="", help="extra server args, one shell-quoted string, "
                   "e.g. '--attention-backend flashinfer'")
    p.add_argument("--parallel", action="store_true",
                   help="start every mode's server at once on its own port (GPU: each with --max-total-tokens "
                        "--parallel-kv-tokens and --mem-fraction-static 0.95 so they share one GPU) and play the "
                        "modes' tasks side by side: accuracy and fidelity only, the latencies overlap")
    p.add_argument("--tasks-time-budget", type=float, default=None, metavar="S",
                   help="per mode: tasks not started within S seconds are skipped (reported), so one slow mode "
                        "cannot take the whole run; comparisons use the turns both runs answered")
    p.add_argument("--parallel-kv-tokens", type=int, default=400000,
                   help="with --parallel on cuda: KV pool of each server in tokens (default 400000)")
    p.add_argument("--rerender", default=None, metavar="DIR",
                   help="only rebuild report/plots/baseline JSON of an earlier run from DIR/run.json and "
                        "DIR/raw/*.json (e.g. on a machine with matplotlib); starts no server")
    p.add_argument("--baseline-json", default=None, metavar="PATH",
                   help="where the dense headline JSON goes (default OUT/baseline_dense.json)")
    p.add_argument("server_extra", nargs=argparse.REMAINDER,
                   help="anything after '--' is passed to launch_server too")
    a = p.parse_args(argv)
    a.extra = shlex.split(a.server_args) + [x for x in a.server_extra if x != "--"]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.mode_list = ["off"] + [m for m in modes if m != "off"]
    try:
        a.configs = parse_mode_configs(a.sparse_config)
    except ValueError as e:
        p.error(str(e))
    if a.fidelity_probes is not None and a.fidelity_probes < 0:
        p.error("--fidelity-probes must be >= 0")
    if a.concurrency is None:
        a.concurrency = 1 if a.device == "cpu" else 8
    if a.server_timeout is None:
        a.server_timeout = 300.0 if a.device == "cpu" else 900.0
    a.out = Path(a.out) if a.out else REPO / "bench" / "results" / "tmp" / f"{a.preset}-{a.device}"
    return a


def rerender(run_dir: Path, baseline_json: str | None = None) -> int:
    """Rebuild the report of an earlier run from its saved records."""
    run = json.loads((run_dir / "run.json").read_text())
    results = {m: json.loads((run_dir / "raw" / f"{m}.json").read_text())
               for m in run["modes"] if (run_dir / "raw" / f"{m}.json").is_file()}
    path = report.write_report(run_dir, results, tasks.PRESETS[run["preset"]], run["meta"], run["errors"],
                               Path(baseline_json) if baseline_json else None)
    print(f"report rebuilt: {path}")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.rerender:
        return rerender(Path(a.rerender), a.baseline_json)
    out = a.out
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    logf = open(out / "driver.log", "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    if not Path(a.model).is_dir():
        log(f"error: model folder '{a.model}' does not exist (build it: python -m sglang_sparse.tools.build_model)")
        return 2
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    preset = tasks.PRESETS[a.preset]
    suite = tasks.generate(preset, a.seed)
    if preset.long:  # interleave kinds, lengths and positions, so a time-budgeted run still covers every cell
        import random
        random.Random(f"order|{a.seed}").shuffle(suite)
    prompts = tasks.fidelity_prompts(preset, a.seed)
    if a.fidelity_probes is not None:  # a prefix of the preset's probes: the same probes as a full run's first N
        prompts = prompts[:a.fidelity_probes]
    pairs = harness.tokenize_pairs(tok, prompts)
    meta = envinfo.collect(a.python, [sys.executable, "-m", "bench.run_harness"] + (argv or sys.argv[1:]))
    meta.update({"device": a.device, "model": a.model, "model_name": Path(a.model).name, "dtype": a.dtype,
                 "preset": f"{preset.name} ({preset.description})", "seed": a.seed,
                 "tasks": f"{len(suite)} tasks, {sum(len(t.turns) for t in suite)} turns; "
                          f"{len(pairs)} fidelity probes of ~{_mean_len(pairs)} tokens"
                          + (f" (--fidelity-probes {a.fidelity_probes} of the preset's {preset.fidelity_prompts})"
                             if a.fidelity_probes is not None else ""),
                 "fidelity probes": len(pairs),
                 "corpus": tasks.corpus.source_description(), "modes": ", ".join(a.mode_list), "task concurrency": a.concurrency,
                 "extra server args": " ".join(a.extra) or "(none)"})
    log(f"[driver] {meta['tasks']}; modes {a.mode_list}; out {out}")
    results: dict = {}
    errors: dict = {}
    signal.signal(signal.SIGTERM, _sigterm)

    def save(mode: str) -> None:
        (out / "raw" / f"{mode}.json").write_text(json.dumps(results[mode], default=str))
        (out / "run.json").write_text(json.dumps({"preset": preset.name, "modes": a.mode_list, "meta": meta,
                                                  "errors": errors}, indent=1, default=str))
        path = report.write_report(out, results, preset, meta, errors,
                                   Path(a.baseline_json) if a.baseline_json else None)
        log(f"[driver] report written: {path}")

    servers: list[Server] = []

    def one(i: int, mode: str) -> None:
        extra = list(a.extra)
        if a.parallel and a.device == "cuda":
            extra += ["--mem-fraction-static", "0.95", "--max-total-tokens", str(a.parallel_kv_tokens)]
        spec = ServerSpec(a.python, a.model, a.device, a.port + (i if a.parallel else 0), mode,
                          a.configs.get(mode), a.dtype, extra)
        mlog = (lambda msg: log(f"[{mode}] {msg}")) if a.parallel else log
        srv = Server(spec, out / "logs" / f"{mode}.log", a.server_timeout, mlog)
        servers.append(srv)
        t0 = time.monotonic()
        try:
            with srv:
                info = srv.server_info()
                states = info.get("internal_states") or [{}]
                rec = {"server": {"sparse": info.get("sparse"), "sparse_config": info.get("sparse_config"),
                                  "attention_backend": info.get("attention_backend"),
                                  "max_model_len": _max_model_len(srv.base_url),
                                  "reported": (states[0] or {}).get("sparse")},
                       "startup_s": srv.startup_s}
                rec.update(harness.run_mode(srv.base_url, preset, suite, pairs, a.model, mlog, a.concurrency, mode,
                                            a.tasks_time_budget))
                # the mode's cumulative statistics after the tasks and probes (`reported` is at start-up)
                after = srv.server_info().get("internal_states") or [{}]
                rec["server"]["reported_after"] = (after[0] or {}).get("sparse")
                results[mode] = rec  # kept even if stopping the server is interrupted
            mlog(f"[driver] mode {mode} done in {time.monotonic() - t0:.0f}s")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (e.g. `timeout`): server already stopped
            errors[mode] = "interrupted (SIGINT/SIGTERM); later modes not run"
            results.setdefault(mode, {})
            mlog(f"[driver] mode {mode} INTERRUPTED")
            raise
        except Exception as e:  # keep going: partial results beat none
            errors[mode] = f"{type(e).__name__}: {e}"
            results.setdefault(mode, {})
            mlog(f"[driver] mode {mode} FAILED: {errors[mode]}")

    if a.parallel:
        import threading
        lock = threading.Lock()

        def worker(i, mode):
            try:
                one(i, mode)
            except KeyboardInterrupt:
                pass
            with lock:
                save(mode)

        threads = [threading.Thread(target=worker, args=(i, m), daemon=True) for i, m in enumerate(a.mode_list)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(timeout=1.0)
        except KeyboardInterrupt:  # the servers' context managers stop them as their threads unwind
            log("[driver] interrupted; stopping the servers")
            for srv in servers:
                srv.stop()
            for t in threads:
                t.join(timeout=60)
    else:
        for i, mode in enumerate(a.mode_list):
            try:
                one(i, mode)
            except KeyboardInterrupt:
                save(mode)
                break
            save(mode)
    for m in a.mode_list:
        if m in results and results[m].get("tasks"):
            h = report.headline(results[m], preset)
            log(f"[driver] {m}: accuracy by position " +
                ", ".join(f"{p} {v:.2f}" for p, v in h["accuracy_by_position"].items()))
    return 1 if errors else 0


def _sigterm(signum, frame):
    """Turn SIGTERM into KeyboardInterrupt so the running server is stopped on the way out."""
    raise KeyboardInterrupt


def _max_model_len(base_url: str) -> int | None:
    """The served context length (``/v1/models`` ``max_model_len``)."""
    import requests
    try:
        return requests.get(base_url + "/v1/models", timeout=30).json()["data"][0].get("max_model_len")
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return None


def _mean_len(pairs) -> int:
    return int(sum(len(c) for c, _ in pairs) / max(1, len(pairs)))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
