"""Reliability headline: a soak run (``python -m bench.soak --launch ...``) and fault runs (``python -m bench.faults``)
folded into ``reliability.json`` and a short Markdown report.

    python -m bench.reliability --soak soak.json --faults faults_psa.json faults_samkv.json \\
        --gpu "NVIDIA H100 80GB HBM3" --out bench/results/reliability.json --md bench/results/reliability.md

``reliability.json`` = ``{"gpu", "modes": {MODE: {"sent", "completed", "aborted", "failed", "wrong_vs_off", "http_5xx",
"rss_slope_mb_per_1k_requests", "idle_leak_check"}}, "faults_tried", "faults_survived"}`` plus the run's context
(``soak_seconds`` per mode, the faults not survived, the commands). Every figure is read from the driver reports; a
mode whose server did not start is listed under ``modes_not_started`` with its error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.mode_settings import mode_label

HEADLINE_KEYS = ("sent", "completed", "aborted", "failed", "wrong_vs_off", "http_5xx")
TARGETS = "failed 0, http_5xx 0, wrong_vs_off 0, faults_survived = faults_tried, idle check silent, RSS slope within noise"


def fold(soak: dict | list[dict], faults: list[dict], gpu: str, commands: list[str] | None = None,
         labels: list[str] | None = None) -> dict:
    """The headline from one or more ``bench.soak --launch`` reports and any number of ``bench.faults`` reports.

    Several soak reports: each compares its modes with the ``off`` server of its own run (``wrong_vs_off`` as the
    driver counted it), so a mode soaked under other server arguments (samkv on a backend whose deterministic mode
    keeps the radix cache) is judged against a dense server with the same arguments. The first report's modes
    come first; a later report adds its modes (replacing a mode of the same name) and its ``off`` row is kept in
    ``soak_details`` as ``off (LABEL)``, with ``mode_runs`` naming the run of each mode."""
    soaks = soak if isinstance(soak, list) else [soak]
    labels = list(labels or []) + [None] * (len(soaks) - len(labels or []))
    labels = [lab or f"run {i + 1}" for i, lab in enumerate(labels)]
    rep = _fold_one(soaks[0], faults, gpu, commands)
    rep["mode_runs"] = {m: labels[0] for m in rep["modes"]}
    if rep.get("noise_floor_off_repeat"):
        rep["noise_floor_off_repeat"]["run"] = labels[0]
    for run, label in zip(soaks[1:], labels[1:]):
        more = _fold_one(run, [], gpu)
        for mode, row in more["modes"].items():
            key = mode if mode != "off" else f"off ({label})"
            if mode != "off":
                rep["modes"][mode] = row
                rep["mode_runs"][mode] = label
                rep["modes_not_started"].pop(mode, None)
                _set_config(rep, mode, more["mode_configs"].get(mode))
            rep["soak_details"][key] = more["soak_details"][mode]
        for mode, err in more["modes_not_started"].items():
            if mode not in rep["modes"]:
                rep["modes_not_started"][mode] = err
        if more.get("noise_floor_off_repeat"):
            rep[f"noise_floor_off_repeat ({label})"] = more["noise_floor_off_repeat"]
        rep["soak_seconds_total"] = round(rep["soak_seconds_total"] + more["soak_seconds_total"], 1)
    return rep


def _fold_one(soak: dict, faults: list[dict], gpu: str, commands: list[str] | None = None) -> dict:
    modes, not_started, extra, configs = {}, {}, {}, {}
    off_facts = ((soak.get("modes") or {}).get("off") or {}).get("facts") or {}
    noise = None
    for mode, rep in (soak.get("modes") or {}).items():
        if mode == "off_repeat" and "error" not in rep:  # a second dense run: the fact checks' noise floor
            noise = {"wrong_vs_off": rep.get("wrong_vs_off"), "facts_checked": rep.get("facts_checked"),
                     "right_where_off_wrong": _flips(rep, off_facts), "failed": rep.get("failed"),
                     "http_5xx": rep.get("http_5xx"), "seconds": rep.get("elapsed_s")}
            continue
        if "error" in rep:
            not_started[mode] = str(rep["error"])[-300:]
            continue
        row = {k: rep.get(k) for k in HEADLINE_KEYS}
        row["rss_slope_mb_per_1k_requests"] = (rep.get("rss") or {}).get("slope_mb_per_1k_requests")
        row["idle_leak_check"] = rep.get("idle_leak_check")
        modes[mode] = row
        if rep.get("sparse_config"):  # the config the server reported (bench.mode_settings labels the row by it)
            configs[mode] = rep["sparse_config"]
        samples = (rep.get("rss") or {}).get("samples") or []
        extra[mode] = {"seconds": rep.get("elapsed_s"), "facts_checked": rep.get("facts_checked"),
                       "wrong": rep.get("wrong"), "http_4xx": rep.get("http_4xx"),
                       "rejected_as_expected": rep.get("rejected_as_expected"),
                       "rss_mb_first_last": [samples[0].get("rss_mb"), samples[-1].get("rss_mb")] if samples else None,
                       "gpu_mb_last": samples[-1].get("gpu_mb") if samples else None,
                       # [requests sent, RSS MB] of every sample: where the memory went during the run
                       "rss_series": [[s_.get("requests"), s_.get("rss_mb")] for s_ in samples],
                       "metrics_consistent": (rep.get("metrics") or {}).get("consistent"),
                       # the other direction of wrong_vs_off: how many flips batch nondeterminism alone could explain
                       "right_where_off_wrong": _flips(rep, off_facts)}
    runs = [f for f in faults if f]
    tried = sum(int(f.get("faults_tried", 0)) for f in runs)
    survived = sum(int(f.get("faults_survived", 0)) for f in runs)
    fault_modes = sorted({str(r.get("mode")) for f in runs for r in f.get("faults", [])})
    lost = [{"fault": r.get("fault"), "mode": r.get("mode"), "outcome": r.get("outcome"),
             "checks": r.get("checks"), "details": r.get("details")}
            for f in runs for r in f.get("faults", []) if not r.get("survived")]
    total_s = sum(float(d.get("seconds") or 0) for d in extra.values()) + float((noise or {}).get("seconds") or 0)
    return {"gpu": gpu, "modes": modes, "faults_tried": tried, "faults_survived": survived,
            "faults_not_survived": lost, "modes_not_started": not_started, "soak_details": extra,
            "soak_seconds_total": round(total_s, 1), "noise_floor_off_repeat": noise, "mode_configs": configs,
            "fault_devices": sorted({str(f.get("device")) for f in runs}), "fault_modes_run": fault_modes,
            "targets": TARGETS,
            "commands": list(commands or [])}


def _set_config(rep: dict, mode: str, config: dict | None) -> None:
    """``rep["mode_configs"][mode]`` = ``config``, or no entry when the run reported none."""
    configs = rep.setdefault("mode_configs", {})
    if config:
        configs[mode] = config
    else:
        configs.pop(mode, None)


def merge_into(base: dict, new: dict, label: str) -> dict:
    """``base`` (an earlier headline) with the modes soaked in ``new`` replaced: their rows, soak details and run
    label; ``new``'s ``off`` kept as ``off (LABEL)``. Faults: the modes ``new``'s fault reports ran replace the
    base's for those modes. A mode's fault count is the number of :data:`bench.faults.FAULTS` entries that apply to
    it (the base keeps totals only); the base's not-survived faults of those modes are dropped with them."""
    from bench.faults import FAULTS

    rep = json.loads(json.dumps(base))
    rep.setdefault("mode_runs", {})
    for mode, row in new["modes"].items():
        if mode == "off":
            rep["soak_details"][f"off ({label})"] = new["soak_details"][mode]
            continue
        rep["modes"][mode] = row
        rep["soak_details"][mode] = new["soak_details"][mode]
        rep["mode_runs"][mode] = label
        rep.get("modes_not_started", {}).pop(mode, None)
        (rep.get("notes") or {}).pop(mode, None)
        _set_config(rep, mode, (new.get("mode_configs") or {}).get(mode))  # the replaced row's settings go with it
    fault_modes = sorted({m for m in new.get("fault_modes_run", [])})
    if fault_modes:
        old = sum(sum(1 for _, applies in FAULTS.values() if m in applies) for m in fault_modes)
        lost_old = [f for f in rep.get("faults_not_survived", []) if f.get("mode") in fault_modes]
        rep["faults_tried"] = int(rep["faults_tried"]) - old + int(new["faults_tried"])
        rep["faults_survived"] = int(rep["faults_survived"]) - (old - len(lost_old)) + int(new["faults_survived"])
        rep["faults_not_survived"] = [f for f in rep.get("faults_not_survived", []) if f not in lost_old] + \
            new["faults_not_survived"]
        rep["fault_devices"] = sorted(set(rep.get("fault_devices", [])) | set(new.get("fault_devices", [])))
    rep["soak_seconds_total"] = round(float(rep.get("soak_seconds_total") or 0) + float(new["soak_seconds_total"]), 1)
    if new.get("noise_floor_off_repeat"):
        rep[f"noise_floor_off_repeat ({label})"] = new["noise_floor_off_repeat"]
    rep["commands"] = list(rep.get("commands", [])) + list(new.get("commands", []))
    _set_gpus(rep, base, new)
    return rep


def _set_gpus(rep: dict, base: dict, new: dict) -> None:
    """``gpu_by_mode`` (the GPU each soak row ran on) and ``gpu``: one name, or each name with its rows when a merge
    put rows from two GPUs side by side."""
    by_mode = dict(base.get("gpu_by_mode") or {m: base.get("gpu") for m in base.get("modes", {})})
    by_mode.update({m: new.get("gpu") for m in new.get("modes", {}) if m != "off"})  # the base's off row is kept
    by_mode = {m: by_mode[m] for m in rep["modes"] if by_mode.get(m)}
    rep["gpu_by_mode"] = by_mode
    gpus: dict[str, list[str]] = {}
    for m, g in by_mode.items():
        gpus.setdefault(g, []).append(m)
    rep["gpu"] = (next(iter(gpus)) if len(gpus) == 1 else
                  "; ".join(f"{g} ({', '.join(ms)})" for g, ms in gpus.items())) if gpus else rep.get("gpu")


def _flips(rep: dict, off_facts: dict) -> int | None:
    """Facts this run answered right where the ``off`` run answered wrong (None without an ``off`` run)."""
    if not off_facts:
        return None
    return sum(1 for k, ok in (rep.get("facts") or {}).items() if ok is True and off_facts.get(k) is False)


def markdown(rep: dict) -> str:
    lines = ["# Reliability: soak and injected faults", "",
             f"- GPU: {rep['gpu']}", f"- targets: {rep['targets']}", ""]
    lines += ["| mode | sent | completed | aborted | failed | wrong vs off | 5xx | RSS slope MB / 1k req | idle leak check "
              "| facts checked | right where off wrong |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in rep["modes"].items():
        slope = r["rss_slope_mb_per_1k_requests"]
        d = rep["soak_details"].get(mode) or {}
        lines.append(f"| {mode_label(rep, mode)} | {r['sent']} | {r['completed']} | {r['aborted']} | {r['failed']} | {r['wrong_vs_off']} "
                     f"| {r['http_5xx']} | {'n/a' if slope is None else f'{slope:.1f}'} | {r['idle_leak_check']} "
                     f"| {d.get('facts_checked')} | {d.get('right_where_off_wrong')} |")
    runs = rep.get("mode_runs") or {}
    if len(set(runs.values())) > 1:
        lines += ["", "Soak runs (each mode is compared with the `off` server of its own run): "
                  + "; ".join(f"`{m}`: {lab}" for m, lab in runs.items()) + "."]
        for key, d in rep["soak_details"].items():
            if key.startswith("off ("):
                lines.append(f"- `{key}`: {d.get('facts_checked')} facts checked, {d.get('wrong')} wrong "
                             f"(the baseline of that run)")
    for mode, err in rep["modes_not_started"].items():
        lines.append(f"| {mode} | server did not start: {err.splitlines()[-1] if err else ''} |||||||| ")
    if rep.get("soak_seconds_total") is not None:
        lines += ["", f"Soak traffic in all: {rep['soak_seconds_total']:.0f} s."]
    noise = rep.get("noise_floor_off_repeat")
    if noise:
        run = f", {noise['run']} run" if noise.get("run") and len(set((rep.get("mode_runs") or {}).values())) > 1 else ""
        lines += ["", f"Noise floor (`off_repeat`{run}): a second `off` server on the same traffic answered {noise['wrong_vs_off']} facts "
                  f"wrong that the first answered right, and {noise['right_where_off_wrong']} right that it answered "
                  f"wrong ({noise['facts_checked']} checked): "
                  + ("the two `off` runs agree on every fact (batch-invariant servers), so a mode's `wrong vs off` "
                     "is its own." if not (noise['wrong_vs_off'] or noise['right_where_off_wrong']) else
                     "batch composition differs between runs under concurrency, so `wrong vs off` of a mode is read "
                     "against this count.")]
    lines += ["", f"Faults: {rep['faults_survived']} of {rep['faults_tried']} survived "
                  f"(devices: {', '.join(rep['fault_devices']) or 'none'})."]
    for f in rep["faults_not_survived"]:
        lines.append(f"- not survived: `{f['fault']}` / {f['mode']}: outcome {f['outcome']}, checks {f['checks']}")
    for mode, note in (rep.get("notes") or {}).items():
        lines += ["", f"`{mode}`: {note}"]
    if rep["commands"]:
        lines += ["", "Commands:", ""] + [f"    {c}" for c in rep["commands"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--soak", required=True, action="append",
                    help="bench.soak --launch report (JSON); repeat for runs under other server arguments, "
                         "optionally as PATH=LABEL (each run's modes are judged against its own off)")
    ap.add_argument("--faults", nargs="*", default=[], help="bench.faults reports (JSON); missing files are skipped")
    ap.add_argument("--gpu", required=True, help="GPU name as reported by nvidia-smi")
    ap.add_argument("--command", action="append", default=[], help="command that produced the reports (repeat)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--md", help="Markdown report path")
    ap.add_argument("--base", help="an earlier reliability.json: the modes soaked here (and the modes of the fault "
                    "reports) replace its rows; everything else is kept")
    ap.add_argument("--note", action="append", default=[], metavar="MODE=TEXT",
                    help="a reading of a mode's row (repeat), kept as notes[MODE] and printed under the table")
    a = ap.parse_args(argv)
    paths = [x.split("=", 1) if "=" in x else (x, None) for x in a.soak]  # PATH=LABEL (a label may hold "=")
    soaks = [json.loads(Path(p).read_text()) for p, _ in paths]
    faults = [json.loads(Path(p).read_text()) for p in a.faults if Path(p).is_file()]
    rep = fold(soaks, faults, a.gpu, a.command, labels=[lab for _, lab in paths])
    if a.base:
        rep = merge_into(json.loads(Path(a.base).read_text()), rep, paths[0][1] or "run 1")
    notes = dict(x.split("=", 1) for x in a.note if "=" in x)
    if notes:
        rep.setdefault("notes", {}).update(notes)
    Path(a.out).write_text(json.dumps(rep, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
