"""One report over several configurations of a mode on the long-context testbed: the engaged fidelity of each
(a :mod:`bench.run_harness` ``--preset long`` run directory: ``off`` + the mode) and, optionally, their end-to-end
speed from one :mod:`bench.ab_rounds` run.

    python -m bench.variants_report --mode loopserve \\
        --fidelity det:last=RUN_A --fidelity det:all=RUN_B \\
        --fidelity nondet:all=RUN_C --fidelity nondet:last=RUN_D --floor nondet \\
        --ab AB_DIR/ab_rounds.json --out bench/results/loopserve_line_chunks.json

``--fidelity GROUP:LABEL=DIR``: the figures of :func:`bench.report_long.mode_figures` for DIR's mode against DIR's own
``off`` (paired on the same scored turns). Runs of one GROUP share a task suite and server settings. ``--floor
GROUP``: also pair every two ``off`` records of that group's runs against each other, the spread two stock servers
give on the same turns (without ``--enable-deterministic-inference`` bf16 batches differ between runs). The JSON holds
every figure; the markdown beside it tabulates them. Nothing is typed in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from bench import report, report_long

KEEP = ("scored_turns", "accuracy_ratio_by_position", "paired_ci95_by_position", "accuracy_by_position",
        "dense_accuracy_same_turns_by_position", "n_by_position", "accuracy_ratio_by_length", "n_by_length",
        "engaged_fraction", "output_agreement")
POSITIONS = ("begin", "middle", "end")
LENGTHS = ("8k", "16k", "32k")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, help="the sparse mode of the runs (its record in raw/MODE.json)")
    p.add_argument("--fidelity", action="append", default=[], metavar="GROUP:LABEL=DIR",
                   help="a bench.run_harness --preset long run directory (off + MODE)")
    p.add_argument("--floor", action="append", default=[], metavar="GROUP",
                   help="pair the off records of this group's runs against each other (the noise floor)")
    p.add_argument("--ab", default=None, metavar="PATH", help="a bench.ab_rounds ab_rounds.json of the same configs")
    p.add_argument("--out", required=True, help="JSON to write (a .md beside it)")
    a = p.parse_args(argv)
    a.runs = []
    for item in a.fidelity:
        head, sep, path = item.partition("=")
        group, sep2, label = head.partition(":")
        if not sep or not sep2 or not group or not label:
            p.error(f"--fidelity expects GROUP:LABEL=DIR, got '{item}'")
        if not (Path(path) / "run.json").is_file():
            p.error(f"--fidelity {item}: no run.json in '{path}'")
        a.runs.append((group, label, Path(path)))
    groups = {g for g, _, _ in a.runs}
    for g in a.floor:
        if g not in groups:
            p.error(f"--floor {g}: no --fidelity run of that group (groups: {sorted(groups)})")
    if not a.runs and not a.ab:
        p.error("nothing to report: give --fidelity and/or --ab")
    return a


def split_by_engagement(dense: dict, other: dict, preset) -> dict:
    """Output agreement and right answers on the same scored turns, split by whether the turn's request engaged the
    mode (its own report: a sparse prefill, assembled documents or sparse decode steps). The not-engaged side shows
    what the server changes for requests the mode never touched (batching, eager against graph-replayed steps)."""
    d = {r["task_id"]: r for r in report.headline_rows(dense, preset)}
    m = {r["task_id"]: r for r in report.headline_rows(other, preset)}
    out = {}
    for side in ("engaged", "not_engaged"):
        ids = [t for t in sorted(d) if t in m and _engaged(m[t]) == (side == "engaged")]
        out[side] = {"turns": len(ids),
                     "output_agreement": (sum(d[t].get("token_ids") == m[t].get("token_ids") for t in ids) / len(ids)
                                          if ids else None),
                     "dense_right": sum(float(d[t]["score"]) for t in ids),
                     "mode_right": sum(float(m[t]["score"]) for t in ids)}
    return out


def _engaged(row: dict) -> bool:
    s = report_long._summary(row)
    return bool(s.get("sparse_prefill") or s.get("assembled") or int(s.get("sparse_decode_steps") or 0) > 0)


def _load(run_dir: Path, mode: str):
    run, results, preset = report_long.load_run(run_dir)
    if not results.get("off", {}).get("tasks") or not results.get(mode, {}).get("tasks"):
        raise SystemExit(f"error: {run_dir} lacks a completed 'off' or '{mode}' record")
    return run, results, preset


def build(a) -> dict:
    out: dict = {"mode": a.mode, "fidelity": {}, "off_vs_off": {}, "speed": None}
    offs: dict = {}
    for group, label, run_dir in a.runs:
        run, results, preset = _load(run_dir, a.mode)
        meta = run["meta"]
        out.setdefault("gpu", meta.get("gpu"))
        out.setdefault("versions", meta.get("versions"))
        out.setdefault("model", meta.get("model_name"))
        out.setdefault("preset", run["preset"])
        fig = report_long.mode_figures(results["off"], results[a.mode], a.mode, preset)
        out["fidelity"].setdefault(group, {})[label] = {
            "command": meta.get("command"), "server_args": meta.get("extra server args"),
            **{k: fig.get(k) for k in KEEP},
            "by_engagement": split_by_engagement(results["off"], results[a.mode], preset)}
        offs.setdefault(group, []).append((label, results["off"], preset))
    for group in a.floor:
        for (la, ra, preset), (lb, rb, _) in itertools.combinations(offs[group], 2):
            fig = report_long.mode_figures(ra, rb, "off", preset)
            out["off_vs_off"].setdefault(group, {})[f"{la}~{lb}"] = {k: fig.get(k) for k in KEEP}
    if a.ab:
        ab = json.loads(Path(a.ab).read_text())
        out.setdefault("gpu", ab["meta"].get("gpu"))
        out.setdefault("versions", (ab["meta"].get("versions") or {}).get("versions")
                       if isinstance(ab["meta"].get("versions"), dict) else ab["meta"].get("versions"))
        out["speed"] = {"command": ab["meta"].get("command"), "gpu": ab["meta"].get("gpu"),
                        "input_len": ab["meta"].get("input_len"), "rounds": ab["meta"].get("rounds"),
                        "servers": {lab: {c: {"throughput_ratio": v.get("ratio_geomean"),
                                              "median_ttft_ms": v.get("median_ttft_ms"),
                                              "median_tpot_ms": v.get("median_tpot_ms"), "failed": v.get("failed")}
                                          for c, v in cells.items()}
                                    for lab, cells in ab["summary"].items()}}
    return out


def _f(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _row(label: str, m: dict) -> str:
    r, ci, ln = m["accuracy_ratio_by_position"], m["paired_ci95_by_position"], m["accuracy_ratio_by_length"]
    cis = " / ".join(f"[{ci[p][0]:+.1f}, {ci[p][1]:+.1f}]" if ci.get(p) else "n/a" for p in POSITIONS)
    return (f"| {label} | {m['scored_turns']} | " + " | ".join(_f(r.get(p)) for p in POSITIONS) + " | "
            + " | ".join(_f(ln.get(x)) for x in LENGTHS) + f" | {cis} | {_f(m.get('engaged_fraction'))} | "
            + f"{_f(m.get('output_agreement'))} |")


def render_md(rep: dict) -> str:
    head = ("| config | turns | begin | middle | end | 8k | 16k | 32k | diff CI95 begin / middle / end (points) "
            "| engaged | output agreement |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# {rep['mode']}: configurations on the long-context testbed", "",
             f"- GPU: {rep.get('gpu')}" + (f"; model: {rep['model']}; preset `{rep.get('preset')}`"
                                           if rep.get("model") else ""),
             f"- versions: {rep.get('versions')}",
             "- accuracy ratio to `off` on the same scored turns, by question position and by prompt length "
             "(8k <= 12288, 16k <= 24576, 32k above); paired 95 % interval of the difference in points; output "
             "agreement = share of turns whose text equals `off`'s", ""]
    for group, runs in rep["fidelity"].items():
        lines += [f"## Fidelity, runs `{group}`", "", head]
        lines += [_row(label, m) for label, m in runs.items()]
        lines += ["", "Split by whether the turn's request engaged the mode (same turns, its own report):", "",
                  "| config | engaged turns | agreement | right (mode / off) | not engaged turns | agreement | "
                  "right (mode / off) |", "|---|---|---|---|---|---|---|"]
        for label, m in runs.items():
            e, ne = m["by_engagement"]["engaged"], m["by_engagement"]["not_engaged"]
            lines.append(f"| {label} | {e['turns']} | {_f(e['output_agreement'])} | {e['mode_right']:g} / "
                         f"{e['dense_right']:g} | {ne['turns']} | {_f(ne['output_agreement'])} | "
                         f"{ne['mode_right']:g} / {ne['dense_right']:g} |")
        for label, m in runs.items():
            lines.append(f"\n- `{label}`: `{m['command']}`")
        if rep["off_vs_off"].get(group):
            lines += ["", f"Two stock servers on the same turns (`off` of one run against `off` of another, group "
                      f"`{group}`): the noise floor of these runs.", "", head]
            lines += [_row(f"off {pair}", m) for pair, m in rep["off_vs_off"][group].items()]
        lines.append("")
    sp = rep.get("speed")
    if sp:
        cells = list(next(iter(sp["servers"].values())).keys())
        lines += ["## End to end (`bench.ab_rounds`, servers started together, one GPU)", "",
                  f"- GPU: {sp['gpu']}; input {sp['input_len']} tokens; rounds {sp['rounds']}",
                  f"- command: `{sp['command']}`", "",
                  "| server | " + " | ".join(f"{c} throughput / off" for c in cells) + " | "
                  + " | ".join(f"{c} TTFT ms" for c in cells) + " | " + " | ".join(f"{c} TPOT ms" for c in cells)
                  + " |", "|---|" + "---|" * (3 * len(cells))]
        for lab, cs in sp["servers"].items():
            lines.append(f"| {lab} | " + " | ".join(_f(cs[c]["throughput_ratio"]) for c in cells) + " | "
                         + " | ".join(_f(cs[c]["median_ttft_ms"], 1) for c in cells) + " | "
                         + " | ".join(_f(cs[c]["median_tpot_ms"], 2) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    rep = build(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(rep))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
