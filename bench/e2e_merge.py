"""Merge e2e_long.json documents of several ``bench.load`` invocations on the same machine.

    python -m bench.e2e_merge --base A/e2e_long.json --add B/e2e_long.json:lastwindow --out bench/results/e2e_long.json
    python -m bench.e2e_merge --base A/e2e_long.json --add C/e2e_long.json:loopserve@32k_ --out ...   # cells only

``MODE@PREFIX`` takes only that mode's cells whose key starts with ``PREFIX`` (e.g. ``32k_``) from the added
document, the mode's other cells staying the base's. Each mode (or cell) keeps the ratios of the invocation it was
measured in (against that invocation's own ``off`` of the
same cell); nothing is recomputed across invocations. ``mode_sources`` records where each mode came from and
``off_spread`` how far the ``off`` baselines of the invocations differ per cell (max/min - 1 of throughput).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(base: dict, adds: list[tuple[dict, list[str], str]], base_name: str) -> dict:
    out = json.loads(json.dumps(base))
    out["mode_sources"] = {m: base_name for m in base.get("modes", {})}
    spread = {}
    for doc, modes, name in adds:
        if doc.get("gpu") != base.get("gpu"):
            raise SystemExit(f"error: {name} ran on {doc.get('gpu')!r}, the base on {base.get('gpu')!r}")
        for spec in modes:
            m, _, prefix = spec.partition("@")
            if m not in doc.get("modes", {}):
                raise SystemExit(f"error: {name} has no mode {m!r} (has {sorted(doc.get('modes', {}))})")
            if not prefix:
                out["modes"][m] = doc["modes"][m]
                out["mode_sources"][m] = name
                cfg = (doc.get("mode_configs") or {}).get(m)  # the settings go with the rows
                if cfg:
                    out.setdefault("mode_configs", {})[m] = cfg
                else:
                    out.get("mode_configs", {}).pop(m, None)
                continue
            cells = {k: v for k, v in doc["modes"][m].items() if k.startswith(prefix) and isinstance(v, dict)}
            if not cells:
                raise SystemExit(f"error: {name} has no {m!r} cell starting with {prefix!r}")
            out["modes"].setdefault(m, {}).update(cells)
            out.setdefault("cell_sources", {}).setdefault(m, {}).update({k: name for k in cells})
        b_off, a_off = base["modes"].get("off", {}), doc["modes"].get("off", {})
        for key, c in a_off.items():
            t0 = (b_off.get(key) or {}).get("output_throughput_tok_s") if isinstance(b_off.get(key), dict) else None
            t1 = c.get("output_throughput_tok_s") if isinstance(c, dict) else None
            if t0 and t1:
                spread[key] = max(spread.get(key, 0.0), max(t0, t1) / min(t0, t1) - 1.0)
    out["off_spread"] = spread
    out["source"] = "bench/e2e_merge.py over bench/load.py invocations (mode_sources)"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True)
    p.add_argument("--add", action="append", default=[], metavar="PATH:MODE[,MODE]")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    adds = []
    for item in a.add:
        path, sep, modes = item.rpartition(":")
        if not sep or not modes:
            p.error(f"--add expects PATH:MODE[,MODE], got {item!r}")
        adds.append((json.loads(Path(path).read_text()), modes.split(","), path))
    doc = merge(json.loads(Path(a.base).read_text()), adds, a.base)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}: modes {sorted(doc['modes'])}; off spread max "
          f"{max(doc['off_spread'].values(), default=0):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
