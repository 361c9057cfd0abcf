"""Where a server's scheduler spends its host time under load: py-spy samples of the scheduler process, per mode.

    python -m bench.host_profile --model /tmp/models/SmolLM2-135M-Instruct-32k --modes off,psa \\
        --input-len 4096 --concurrency 1,8 --prompts 48 --server-args '--attention-backend flashinfer' --out DIR

For each mode, one server at a time (``bench.server``): one warm-up request, then per ``--concurrency`` cell
(``--prompts`` streamed completions of ``--input-len`` token-exact prose tokens, ``--output-len`` tokens,
:func:`bench.load_client.run_cell`) twice: once plain (throughput, TPOT) and once while ``py-spy record``
(``--nonblocking``: the process is never paused) samples the scheduler process (the server's child whose command
line names the scheduler). The folded stacks are reduced to:

* ``self``: the share of samples whose innermost frame is each function (the top ``--top``);
* ``inclusive``: the share of samples with each function anywhere on the stack, for frames of this project
  (``sglang_sparse``, ``flashinfer_ext``, ``radix_sparse``); ``scheduler``: the same for SGLang's scheduler, TP
  worker and model runner frames;
Only the scheduler's main thread counts (stacks through ``run_scheduler_process``; not its watchdog threads).

* ``idle``: samples in a wait (``poll``/``recv``/``select``/``sleep``/``synchronize``), where the scheduler waits
  for the GPU or for requests.

Needs the ``py-spy`` executable (``--py-spy``) and the right to read the scheduler's memory (root, or a ptrace
scope that allows it). Writes ``DIR/host_profile.json`` and ``DIR/host_profile.md``; ``--keep-stacks`` keeps the
folded stacks.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.sparse_configs import parse_mode_configs
from bench import envinfo
from bench import load_client as lc
from bench.server import Server, ServerSpec

OURS = ("sglang_sparse", "flashinfer_ext", "radix_sparse")
MAIN = "run_scheduler_process"  # a frame of the scheduler's main thread (other threads: watchdog, ...)
WAITS = ("poll", "recv", "select", "sleep", "synchronize", "wait", "epoll")


def scheduler_pid(server_pid: int, timeout_s: float = 30.0) -> int | None:
    """The scheduler process among the server's descendants (its command line or title names the scheduler)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            for p in psutil.Process(server_pid).children(recursive=True):
                text = " ".join(p.cmdline()) + " " + p.name()
                if "scheduler" in text.lower():
                    return p.pid
        except psutil.Error:
            return None
        time.sleep(0.5)
    return None


def reduce_folded(lines: list[str], top: int = 25) -> dict:
    """Folded stacks (``frame;frame;... count``, outermost first) -> self / inclusive shares and the idle share."""
    total = 0
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    sched: collections.Counter = collections.Counter()
    idle = 0
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        if not frames or not any(MAIN in f for f in frames):  # the scheduler's own thread only
            continue
        total += n
        self_c[frames[-1]] += n
        if any(w in frames[-1].split(" (")[0].lower() for w in WAITS):
            idle += n
        for f in set(frames):
            if any(o in f for o in OURS):
                incl[f] += n
            elif "scheduler" in f.lower() or "tp_worker" in f or "model_runner" in f:
                sched[f] += n
    if not total:
        return {"samples": 0, "idle_share": None, "self": [], "inclusive": [], "scheduler": []}
    share = lambda c: [{"frame": f[:160], "share": round(k / total, 4)} for f, k in c.most_common(top)]  # noqa: E731
    return {"samples": total, "idle_share": round(idle / total, 4), "self": share(self_c), "inclusive": share(incl),
            "scheduler": share(sched)}


def profile_mode(a, mode: str, cfg: str | None, maker, out: Path, log) -> dict:
    spec = ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port, mode=mode, sparse_config=cfg,
                      extra_args=shlex.split(a.server_args))
    rec: dict = {"mode": mode, "sparse_config": cfg}
    rng = random.Random(f"host_profile|{a.input_len}")
    with Server(spec, out / f"server_{mode}.log", timeout_s=a.server_timeout, log=log) as srv:
        lc.stream_completion(srv.url, maker.prompt(a.input_len, rng, 0), 16, a.timeout)
        pid = scheduler_pid(srv.pid)
        rec["cells"] = {}
        for conc in a.conc:
            rec["cells"][str(conc)] = cell = {}
            prompts = maker.cell_prompts(0, a.input_len, conc, a.prompts)
            lc.flush_cache(srv.url)
            cell["plain"] = lc.run_cell(srv.url, prompts, a.output_len, conc, a.timeout)
            lc.flush_cache(srv.url)
            if pid is None:
                cell["error"] = "no scheduler process found among the server's children"
                continue
            folded = out / f"stacks_{mode}_c{conc}.txt"
            spy = subprocess.Popen([a.py_spy, "record", "--pid", str(pid), "--rate", str(a.rate), "--nonblocking",
                                    "--idle", "--format", "raw", "--output", str(folded), "--duration",
                                    str(a.spy_seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(1.0)  # py-spy attached before the cell starts
            cell["sampled"] = lc.run_cell(srv.url, prompts, a.output_len, conc, a.timeout)
            try:
                _, err = spy.communicate(timeout=a.spy_seconds + 60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
            if not folded.is_file():
                cell["error"] = f"py-spy wrote no stacks (exit {spy.returncode}): {(err or '')[-300:]}"
                continue
            cell["stacks"] = reduce_folded(folded.read_text().splitlines(), a.top)
            if not a.keep_stacks:
                folded.unlink()
    return rec


def render_md(rep: dict) -> str:
    m = rep["meta"]
    f = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    lines = ["# Scheduler host profile per mode (bench.host_profile)", "", f"- command: `{m['command']}`",
             f"- gpu: {m['gpu']}", f"- versions: {m['versions']}",
             f"- cell: {m['prompts']} prompts of {m['input_len']} tokens, {m['output_len']} output tokens, concurrency "
             f"{m['concurrency']}; py-spy --nonblocking at {m['rate']} Hz on the scheduler process", "",
             "| mode | concurrency | out tok/s | TPOT ms | out tok/s (sampled) | samples | idle share |",
             "|---|---|---|---|---|---|---|"]
    for r in rep["modes"]:
        for conc, c in (r.get("cells") or {}).items():
            p, s, st = c.get("plain") or {}, c.get("sampled") or {}, c.get("stacks") or {}
            lines.append(f"| {r['mode']} | {conc} | {f(p.get('output_throughput'))} | {f(p.get('mean_tpot_ms'))} | "
                         f"{f(s.get('output_throughput'))} | {st.get('samples', '-')} | {f(st.get('idle_share'))} |")
    for r in rep["modes"]:
        if r.get("error"):
            lines += ["", f"## {r['mode']}", "", f"error: {r['error']}"]
            continue
        for conc, c in (r.get("cells") or {}).items():
            lines += ["", f"## {r['mode']}, concurrency {conc}", ""]
            if c.get("error"):
                lines.append(f"error: {c['error']}")
                continue
            for key, title in (("self", "innermost frame"), ("inclusive", "on the stack: this project"),
                               ("scheduler", "on the stack: SGLang's scheduler, worker and model runner")):
                lines += [f"{title}:", "", "| share | frame |", "|---|---|"]
                lines += [f"| {x['share']:.3f} | `{x['frame']}` |" for x in c["stacks"][key]]
                lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="off,psa")
    ap.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    ap.add_argument("--port", type=int, default=30060)
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated cells, each run on every server")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--spy-seconds", type=int, default=6, help="py-spy recording length")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--server-timeout", type=float, default=900.0)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--keep-stacks", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        a.conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency takes integers, got {a.concurrency!r}")
    if not a.conc or min(a.conc) < 1:
        ap.error(f"--concurrency must list integers >= 1, got {a.concurrency!r}")
    for name in ("input_len", "output_len", "prompts", "rate", "spy_seconds", "top"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        configs = parse_mode_configs(a.sparse_config)
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"{time.strftime('%H:%M:%S')} [host_profile] {msg}", flush=True)

    env = envinfo.collect(a.python, [sys.executable, "-m", "bench.host_profile"] + argv)
    rep = {"meta": {"command": " ".join(["python -m bench.host_profile"] + [shlex.quote(x) for x in argv]),
                    "gpu": env.get("gpu"), "versions": env.get("versions"), "input_len": a.input_len,
                    "output_len": a.output_len, "concurrency": a.conc, "prompts": a.prompts, "rate": a.rate},
           "modes": []}
    maker = lc.PromptMaker(a.model)
    for mode in [m for m in a.modes.split(",") if m]:
        log(f"== {mode}")
        try:
            rec = profile_mode(a, mode, configs.get(mode), maker, out, log)
        except Exception as e:  # recorded; the other modes still run
            rec = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
        log(f"{mode}: " + "; ".join(f"c{k}: {(c.get('plain') or {}).get('output_throughput')} tok/s"
                                    for k, c in (rec.get("cells") or {}).items()) + f" {rec.get('error', '')}")
        rep["modes"].append(rec)
        (out / "host_profile.json").write_text(json.dumps(rep, indent=1))
        (out / "host_profile.md").write_text(render_md(rep))
    print(render_md(rep))
    ok = all("error" not in r and all("error" not in c for c in (r.get("cells") or {}).values())
             for r in rep["modes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
