"""Headline fidelity figures of a harness run (``python -m bench.run_harness --modes off,psa``).

Reads ``DIR/summary.json`` and writes ``psa_fidelity.json``:
``{"gpu", "accuracy_ratio_by_position": {"begin", "middle", "end"}, "output_agreement", ...}``
where each ratio is psa accuracy / dense accuracy at that question position (headline tasks),
and ``output_agreement`` is the fraction of greedy task replies identical to the dense ones.
Everything is computed from the run's records; nothing is typed in.

    python -m bench.psa_fidelity --run DIR --out bench/results/psa_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or not b:
        return None
    return a / b


def _finite(x):
    """``x`` if it is a finite number, else None (no sparse step reported a kept mass: NaN is not JSON)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def fidelity_figures(summary: dict, mode: str = "psa") -> dict:
    modes = summary["modes"]
    if mode not in modes or "off" not in modes:
        raise ValueError(f"the run has modes {sorted(modes)}; need 'off' and '{mode}'")
    dense, sparse = modes["off"]["headline"]["accuracy_by_position"], modes[mode]["headline"]["accuracy_by_position"]
    fid = modes[mode].get("fidelity") or {}
    server = modes[mode].get("server") or {}
    stats = ((server.get("reported_after") or server.get("reported") or {}).get("stats")) or {}
    return {
        "gpu": summary["meta"].get("gpu"),
        "accuracy_ratio_by_position": {p: _ratio(sparse.get(p), dense.get(p)) for p in ("begin", "middle", "end")},
        "output_agreement": fid.get("reply_exact"),
        "dense_accuracy_by_position": dense,
        "sparse_accuracy_by_position": sparse,
        "greedy128_prefix_agreement": fid.get("greedy128_prefix"),
        "teacher_forced_top1": fid.get("top1"),
        "teacher_forced_kl": fid.get("kl"),
        "kept_mass_reported": _finite(fid.get("kept_mass")),
        "server_read_fraction": stats.get("read_fraction"),
        "server_kept_mass_mean": stats.get("kept_mass_mean"),
        # the adaptive switch's probe steps (exact result): the blocks PSA's stop test would read there
        "server_probe_read_fraction": stats.get("probe_read_fraction"),
        "sparse_config": server.get("sparse_config"),
        "command": summary["meta"].get("command"),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="harness output dir (has summary.json)")
    p.add_argument("--mode", default="psa")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    figs = fidelity_figures(json.loads((Path(a.run) / "summary.json").read_text()), a.mode)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(figs, indent=1, default=lambda x: None) + "\n")
    print(json.dumps(figs, indent=1, default=lambda x: None))


if __name__ == "__main__":
    main()
