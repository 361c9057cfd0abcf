"""Server runs under the overlap scheduler: did a server stall or crash, and what did a soak answer.

Folds outputs that already exist into one report (JSON + Markdown); it starts nothing.

* ``--run LABEL DIR`` (repeat): a ``bench.run_harness`` output folder (``driver.log`` and ``logs/MODE.log``).
  Per mode it reports whether the server log holds a CUDA illegal memory access, the longest silence of
  the server log after the server came up (a stall: no batch, no request, no line), the tasks served
  and failed (the driver's last ``[tasks]`` line) and, for samkv, the documents requests assembled.
* ``--setting LABEL TEXT`` (repeat): how that run's servers were set up, printed beside it.
* ``--soak LABEL PATH`` (repeat): a ``bench.soak --launch off,MODE`` report. Per run: the mode's counts,
  its facts lost and won against that run's ``off``, split by traffic kind (``bench.soak.CYCLE``).
* ``--faults LABEL PATH`` (repeat): a ``bench.faults`` report: faults tried and survived.

Example::

    python -m bench.overlap_runs --run A /tmp/testbed/long/long --setting A "overlap on" \\
        --soak A /tmp/testbed/reliability/soak_samkv.json --out bench/results/samkv_overlap
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from datetime import datetime
from pathlib import Path

from bench.soak import CYCLE

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]")
_TASKS = re.compile(r"\[(\w+)\] \[tasks\] (\d+)/(\d+) done in (\d+)s, .*?(\d+) failed")
_ILLEGAL = "an illegal memory access was encountered"


def server_log_summary(path: Path) -> dict:
    """``{"illegal_memory_access", "longest_silence_s", "silence_from", "assembled"}`` of one server log.

    The silence is the longest gap between consecutive timestamped lines after the first request line
    (``POST``), up to the first line that reports a scheduler exception or a stop."""
    stamps: list[datetime] = []
    started = ended = False
    illegal = False
    assembled = 0
    for line in path.read_text(errors="replace").splitlines():
        illegal = illegal or _ILLEGAL in line
        assembled += "sglang-sparse samkv:" in line and " assembled " in line
        m = _STAMP.match(line)
        if not m or ended:
            continue
        ended = "Scheduler hit an exception" in line or "SIGQUIT" in line or "crashed with exit code" in line
        started = started or "POST " in line or ended
        if started:
            stamps.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
    gaps = [((b - a).total_seconds(), a) for a, b in zip(stamps, stamps[1:])]
    longest, since = max(gaps, default=(0.0, None), key=lambda g: g[0])
    return {"illegal_memory_access": illegal, "longest_silence_s": longest,
            "silence_from": since.strftime("%H:%M:%S") if since else None, "assembled": assembled}


def driver_tasks(path: Path) -> dict[str, dict]:
    """Per mode, the driver's last ``[tasks]`` line: ``{"served", "failed", "total"}`` (served = total - failed)."""
    out: dict[str, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _TASKS.search(line)
        if m:
            mode, _, total, _, failed = m.groups()
            out[mode] = {"served": int(total) - int(failed), "failed": int(failed), "total": int(total)}
    return out


def run_summary(folder: Path) -> dict[str, dict]:
    """Per mode of one harness folder: :func:`server_log_summary` and :func:`driver_tasks` merged."""
    tasks = driver_tasks(folder / "driver.log")
    modes = {}
    for log in sorted((folder / "logs").glob("*.log")):
        modes[log.stem] = {**server_log_summary(log), **tasks.get(log.stem, {})}
    return modes


def soak_flips(report: dict, mode: str) -> dict:
    """The soak's counts for ``mode`` and its facts lost / won against ``off``, by traffic kind."""
    modes = report["modes"]
    off, got = modes["off"]["facts"], modes[mode]["facts"]
    lost, won = collections.Counter(), collections.Counter()
    for key in set(off) & set(got):
        kind = CYCLE[int(key) % len(CYCLE)]
        if off[key] and not got[key]:
            lost[kind] += 1
        elif got[key] and not off[key]:
            won[kind] += 1
    row = {k: modes[mode].get(k) for k in ("sent", "completed", "aborted", "failed", "http_5xx", "wrong_vs_off",
                                           "facts_checked", "idle_leak_check")}
    return {**row, "lost_vs_off_by_kind": dict(sorted(lost.items())), "won_vs_off_by_kind": dict(sorted(won.items()))}


def _pairs(values: list[list[str]] | None) -> dict[str, str]:
    return {label: value for label, value in (values or [])}


def build(args) -> dict:
    settings = _pairs(args.setting)
    out: dict = {"gpu": args.gpu, "runs": {}, "soaks": {}, "faults": {}}
    for label, folder in _pairs(args.run).items():
        out["runs"][label] = {"setting": settings.get(label, ""), "modes": run_summary(Path(folder))}
    for label, path in _pairs(args.soak).items():
        report = json.loads(Path(path).read_text())
        mode = next(m for m in report["modes"] if m != "off")
        out["soaks"][label] = {"setting": settings.get(label, ""), "mode": mode, **soak_flips(report, mode)}
    for label, path in _pairs(args.faults).items():
        report = json.loads(Path(path).read_text())
        out["faults"][label] = {"tried": report["faults_tried"], "survived": report["faults_survived"],
                                "outcomes": {f["fault"]: f["outcome"] for f in report["faults"]}}
    return out


def markdown(rep: dict, commands: list[str], notes: list[str] = ()) -> str:
    lines = [f"# {rep.get('title') or 'Servers under the overlap scheduler'}", "", f"- GPU: {rep['gpu']}"]
    lines += [f"- command: `{c}`" for c in commands]
    lines += ["", "| run | setting | mode | tasks served | failed | longest log silence s | illegal memory access | "
              "documents assembled |", "|---|---|---|---|---|---|---|---|"]
    for label, run in rep["runs"].items():
        for mode, m in run["modes"].items():
            lines.append(f"| {label} | {run['setting']} | {mode} | {m.get('served', '')} / {m.get('total', '')} | "
                         f"{m.get('failed', '')} | {m['longest_silence_s']:.0f} | "
                         f"{'yes' if m['illegal_memory_access'] else 'no'} | {m['assembled']} |")
    if rep["soaks"]:
        lines += ["", "| soak | setting | mode | sent | completed | failed | 5xx | wrong vs off | lost by kind | "
                  "won by kind |", "|---|---|---|---|---|---|---|---|---|---|"]
        for label, s in rep["soaks"].items():
            lines.append(f"| {label} | {s['setting']} | {s['mode']} | {s['sent']} | {s['completed']} | {s['failed']} | "
                         f"{s['http_5xx']} | {s['wrong_vs_off']} | {s['lost_vs_off_by_kind']} | "
                         f"{s['won_vs_off_by_kind']} |")
    if rep["faults"]:
        lines += ["", "| faults | tried | survived | outcomes |", "|---|---|---|---|"]
        for label, f in rep["faults"].items():
            lines.append(f"| {label} | {f['tried']} | {f['survived']} | {f['outcomes']} |")
    for note in notes:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs=2, action="append", metavar=("LABEL", "DIR"))
    ap.add_argument("--setting", nargs=2, action="append", metavar=("LABEL", "TEXT"))
    ap.add_argument("--soak", nargs=2, action="append", metavar=("LABEL", "PATH"))
    ap.add_argument("--faults", nargs=2, action="append", metavar=("LABEL", "PATH"))
    ap.add_argument("--gpu", required=True, help="GPU name as nvidia-smi reports it")
    ap.add_argument("--title", default="", help="the report's heading")
    ap.add_argument("--command", action="append", default=[], help="command that produced the inputs (repeat)")
    ap.add_argument("--note", action="append", default=[], help="a paragraph printed under the tables (repeat)")
    ap.add_argument("--out", required=True, help="output path without suffix: writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if not (args.run or args.soak or args.faults):
        ap.error("give at least one --run, --soak or --faults")
    for label, folder in args.run or []:
        if not (Path(folder) / "driver.log").is_file():
            ap.error(f"--run {label}: {folder} has no driver.log (a bench.run_harness output folder)")
    rep = build(args)
    if args.title:
        rep["title"] = args.title
    rep["commands"] = args.command
    rep["notes"] = args.note
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rep, args.command, args.note))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
