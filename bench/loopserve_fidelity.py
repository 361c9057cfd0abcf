"""Headline fidelity figures of one harness run with LoopServe and its last-window baseline.

    python -m bench.run_harness --modes off,loopserve,lastwindow ... --out DIR
    python -m bench.loopserve_fidelity --run DIR --out bench/results/loopserve_fidelity.json

Reads ``DIR/summary.json`` and writes
``{"gpu", "accuracy_ratio_by_position": {"begin", "middle", "end"},
"lastwindow_accuracy_ratio_by_position": {...}, ...}``: each ratio is the mode's accuracy / dense
accuracy at that question position (headline tasks; ``--lastwindow-run DIR`` takes the lastwindow
figures from a second run, against that run's own dense), plus per mode the figures of
:func:`bench.psa_fidelity.fidelity_figures` (reply agreement, teacher-forced top-1 / KL, the
server's reported statistics and config) and whether the last-window baseline drops where the
question is not last. Where the run dirs hold the raw records, each mode also gets ``paired_by_position``
(:mod:`bench.paired`: tasks that differ from dense, and a paired bootstrap 95 % interval of the ratio).
Everything is computed from the run's records; nothing is typed in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.paired import paired_by_position
from bench.psa_fidelity import fidelity_figures
from bench.tasks import PRESETS

POSITIONS = ("begin", "middle", "end")


def loopserve_figures(summary: dict, lastwindow_summary: dict | None = None) -> dict:
    """``lastwindow_summary``: a second run (modes off + lastwindow) to take the lastwindow figures
    from, each ratio against that run's own ``off``; default: ``summary``."""
    out: dict = {"gpu": summary["meta"].get("gpu")}
    for mode, key in (("loopserve", "accuracy_ratio_by_position"),
                      ("lastwindow", "lastwindow_accuracy_ratio_by_position")):
        src = lastwindow_summary if mode == "lastwindow" and lastwindow_summary is not None else summary
        modes = src["modes"]
        if mode not in modes:
            out[key] = {p: None for p in POSITIONS}
            out[mode] = {"error": f"mode '{mode}' is not in the run (modes: {sorted(modes)})"}
            continue
        figs = fidelity_figures(src, mode)
        server = modes[mode].get("server") or {}
        figs["server_stats"] = (server.get("reported_after") or server.get("reported") or {}).get("stats")
        out[key] = figs["accuracy_ratio_by_position"]
        out[mode] = figs
    lw = out["lastwindow_accuracy_ratio_by_position"]
    if all(isinstance(lw.get(p), (int, float)) for p in POSITIONS):
        out["lastwindow_drop_begin_vs_end"] = lw["end"] - lw["begin"]
        out["lastwindow_drop_middle_vs_end"] = lw["end"] - lw["middle"]
    out["command"] = summary["meta"].get("command")
    if lastwindow_summary is not None:
        out["lastwindow_command"] = lastwindow_summary["meta"].get("command")
    return out


def paired_from_run(run_dir: Path, mode: str) -> dict | None:
    """:func:`bench.paired.paired_by_position` of ``mode`` against the run's own ``off`` from its raw
    records (``run.json`` names the preset); None when the run has no raw records of both."""
    raw = run_dir / "raw"
    if not (run_dir / "run.json").is_file() or not (raw / "off.json").is_file() or not (raw / f"{mode}.json").is_file():
        return None
    preset = PRESETS[json.loads((run_dir / "run.json").read_text())["preset"]]
    return paired_by_position(json.loads((raw / "off.json").read_text()),
                              json.loads((raw / f"{mode}.json").read_text()), preset)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="harness output dir (has summary.json)")
    p.add_argument("--lastwindow-run", default=None, metavar="DIR",
                   help="a second harness dir (modes off,lastwindow) for the lastwindow figures; each ratio is "
                        "against that run's own off (default: --run)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    lw = json.loads((Path(a.lastwindow_run) / "summary.json").read_text()) if a.lastwindow_run else None
    figs = loopserve_figures(json.loads((Path(a.run) / "summary.json").read_text()), lw)
    # paired per-task figures (tasks that differ, bootstrap interval of the ratio) where raw records exist
    for mode, run_dir in (("loopserve", a.run), ("lastwindow", a.lastwindow_run or a.run)):
        if isinstance(figs.get(mode), dict) and "error" not in figs[mode]:
            figs[mode]["paired_by_position"] = paired_from_run(Path(run_dir), mode)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(figs, indent=1, default=lambda x: None) + "\n")
    print(json.dumps({k: figs[k] for k in ("gpu", "accuracy_ratio_by_position",
                                           "lastwindow_accuracy_ratio_by_position")}, indent=1))


if __name__ == "__main__":
    main()
