"""How many blocks PSA reads on real attention, against how many it would need: a report of
``bench.psa_real_capture`` summaries.

For each captured decode step (prompt length, needle depth) and each analysed config: the fraction of blocks the
config's stop test read, the smallest true kept mass over the (layer, KV head) pairs, the pairs whose output error
against dense exceeds 0.1, and the fraction of blocks each rank order needs so that every query head of the group
keeps 95 % of its true mass (mean over the pairs): ``mean`` (PSA's rank order), ``cuboid`` and ``oracle`` (the
true block masses: the floor for any ranking). The gap between the read fraction and the ``mean`` column is what
the stop test costs; the gap between ``mean`` and ``oracle`` is what the ranking costs.

Usage::

    python -m bench.psa_read_floor /tmp/psacap/summary_16000.json ... --out bench/results/psa_read_floor
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run_env() -> str:
    """The CPU and the versions of this interpreter (the one that ran the captures and the analysis)."""
    import os
    import sys

    from bench.envinfo import collect, cpu_model

    return f"CPU, {os.cpu_count()} CPUs ({cpu_model()}); " + collect(sys.executable)["versions"]


def rows_of(summary: dict) -> list[dict]:
    """One row per (captured step, config) of one ``summary_<tokens>.json``."""
    out = []
    for run in summary["runs"]:
        for name, rec in run["variants"].items():
            s = rec.get("summary")
            if s is None:
                continue
            pairs = rec["analysis"]["rows"]
            out.append({"prompt_len": run["prompt_len"], "depth": run["depth"], "seed": run["seed"],
                        "dense_correct": run["dense_correct"], "config": name,
                        "read_frac": s["read_frac"], "kept_true_min": s["kept_true_min"],
                        "pairs_out_err_gt_0.1": sum(1 for r in pairs if r["out_err"] > 0.1), "pairs": len(pairs),
                        "needle_unread_pairs": sum(1 for r in pairs if not r["needle_read"]),
                        "blocks95_mean_order": s["blocks95_mean"]["mean"],
                        "blocks95_cuboid_order": s["blocks95_cuboid"]["mean"],
                        "blocks95_oracle": s["blocks95_oracle"]["mean"],
                        "blocks95_oracle_max": s["blocks95_oracle"]["max"]})
    return out


def markdown(rows: list[dict], command: str, env: str) -> str:
    lines = ["# PSA on real attention: blocks read against the blocks needed", "",
             f"- command: `{command}`",
             f"- device and versions: {env}",
             "- CPU reference (`flashinfer_ext.common.reference`), fp32, the 32k testbed model (SmolLM2-135M-Instruct, "
             "YaRN x4), block 16; one decode step per prompt: the step that emits the needle's first digit",
             "- read: blocks the config's stop test read (mean over the (layer, KV head) pairs); needed: blocks for "
             "every query head of the group to keep 95 % of its true mass, in PSA's rank order (`mean`), in the "
             "cuboid bound's order and in the true masses' order (`oracle`, the floor for any ranking)", "",
             "| prompt tokens | depth | config | read | smallest true kept mass | pairs with output error > 0.1 | "
             "pairs with the needle unread | needed, mean order | needed, cuboid order | needed, oracle "
             "(largest pair) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['depth']:.0%} | {r['config']} | {r['read_frac']:.3f} | "
                     f"{r['kept_true_min']:.4f} | {r['pairs_out_err_gt_0.1']} / {r['pairs']} | "
                     f"{r['needle_unread_pairs']} | {r['blocks95_mean_order']:.3f} | {r['blocks95_cuboid_order']:.3f} | "
                     f"{r['blocks95_oracle']:.3f} ({r['blocks95_oracle_max']:.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="+", help="summary_<tokens>.json files of bench.psa_real_capture")
    ap.add_argument("--command", default="", help="the command that produced the summaries")
    ap.add_argument("--note", action="append", default=[], help="a paragraph printed under the table (repeat)")
    ap.add_argument("--out", required=True, help="output path without suffix: writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    rows = [r for p in a.summaries for r in rows_of(json.loads(Path(p).read_text()))]
    if not rows:
        ap.error("no analysed config in the given summaries")
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"command": a.command, "env": run_env(), "rows": rows}, indent=1))
    md = markdown(rows, a.command, run_env()) + "".join(f"\n{n}\n" for n in a.note)
    out.with_suffix(".md").write_text(md)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
