"""Headline figures of a long-context harness run (:mod:`bench.tasks_long`, the ``long`` presets).

    python -m bench.report_long --run DIR [--json bench/results/fidelity_long.json]
                                [--psa-json bench/results/psa_fidelity.json]
                                [--loopserve-json bench/results/loopserve_fidelity.json]
    python -m bench.report_long --needle-run DIR [--needle-json bench/results/needle_table.json]

Inputs are a :mod:`bench.run_harness` output directory (``run.json``, ``raw/<mode>.json``,
``summary.json``). Every figure is computed from the raw per-turn records, nothing typed in:

* per mode and question position (needle: depth 10 / 50 / 90 %): accuracy, dense's accuracy on
  the same turns, the ratio, and a paired bootstrap 95 % interval of the difference in points
  (mode - dense; the same resampled turns for both);
* per prompt length bucket (:data:`LENGTH_BUCKETS`, by the scored request's prompt tokens) the same
  ratio, and the share of the bucket's work that took the mode's sparse path;
* ``engaged_fraction`` (see :func:`engaged`), ``output_agreement`` (scored replies token-identical
  to dense's);
* cells where dense scores below :data:`DENSE_FLOOR` are flagged ``dense_below_floor``: a ratio
  there says little.

The needle table (dense retrieval by length and depth) comes from a run of the ``needle_table``
preset (``off`` only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from bench import report, tasks
from bench.conc_stats import percentile

POSITIONS = tasks.POSITIONS
LENGTH_BUCKETS = (("8k", 12288), ("16k", 24576), ("32k", 1 << 30))  # prompt tokens <= bound
DENSE_FLOOR = 0.3
N_BOOT = 2000
# Which part of the work is the mode's sparse path (engaged_fraction): prefill tokens, decode steps or both.
ENGAGED_PARTS = {"psa": ("decode",), "lastwindow": ("decode",), "loopserve": ("prefill", "decode"),
                 "samkv": ("prefill",)}


def bucket_of(prompt_tokens: int | None) -> str:
    n = prompt_tokens or 0
    return next(name for name, hi in LENGTH_BUCKETS if n <= hi)


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return None if a is None or not b else a / b


def _summary(row: dict) -> dict:
    s = row.get("sparse") or {}
    return (s[0] if s else {}) if isinstance(s, list) else s


def engaged(rows: list[dict], mode: str) -> dict:
    """Share of the work that took the sparse path, from each request's own report (``sparse``):

    * prefill: prompt tokens of requests whose prefill ran sparse (loopserve ``sparse_prefill``; samkv
      ``assembled`` documents) over all prompt tokens;
    * decode: decode steps reported sparse (``sparse_decode_steps``) over all decode steps
      (completion tokens - 1, the first token comes from prefill);
    * ``engaged_fraction``: the mean of the parts of :data:`ENGAGED_PARTS` for the mode.
    """
    pre_s = pre_t = dec_s = dec_t = 0
    for r in rows:
        s = _summary(r)
        prompt = r.get("prompt_tokens") or 0
        steps = max(0, (r.get("completion_tokens") or 0) - 1)
        pre_t += prompt
        dec_t += steps
        if s.get("sparse_prefill") or s.get("assembled"):
            pre_s += prompt
        dec_s += min(steps, int(s.get("sparse_decode_steps") or 0))
    parts = {"prefill": pre_s / pre_t if pre_t else 0.0, "decode": dec_s / dec_t if dec_t else 0.0}
    want = ENGAGED_PARTS.get(mode, ("prefill", "decode"))
    return {"engaged_fraction": sum(parts[p] for p in want) / len(want),
            "engaged_prefill_fraction": parts["prefill"], "engaged_decode_fraction": parts["decode"]}


def paired_diff_ci(pairs: list[tuple[float, float]], seed: int = 0, n_boot: int = N_BOOT) -> list[float] | None:
    """Paired percentile bootstrap 95 % interval of mean(mode) - mean(dense), in points (x100)."""
    if not pairs:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    boot = []
    for _ in range(n_boot):
        tot = 0.0
        for _ in range(n):
            d, m = pairs[rng.randrange(n)]
            tot += m - d
        boot.append(100.0 * tot / n)
    return [percentile(boot, 2.5), percentile(boot, 97.5)]


def _rows(rec: dict, preset) -> dict[str, dict]:
    return {r["task_id"]: r for r in report.headline_rows(rec, preset)}


def mode_figures(dense: dict, other: dict, mode: str, preset) -> dict:
    """The fidelity_long.json entry of one mode against dense on the same scored turns."""
    d, m = _rows(dense, preset), _rows(other, preset)
    ids = sorted(t for t in d if t in m)
    out: dict = {"scored_turns": len(ids), "accuracy_ratio_by_position": {}, "paired_ci95_by_position": {},
                 "accuracy_by_position": {}, "dense_accuracy_same_turns_by_position": {},
                 "n_by_position": {}, "dense_below_floor": [], "accuracy_ratio_by_length": {},
                 "accuracy_by_length": {}, "dense_accuracy_by_length": {}, "n_by_length": {},
                 "engaged_fraction_by_length": {}, "dense_at_length": []}
    def cell(sel: list[str], suffix: str, key: str) -> None:
        """Accuracy, dense accuracy on the same turns, their ratio and n of the turns ``sel`` under ``key``."""
        pairs = [(float(d[t]["score"]), float(m[t]["score"])) for t in sel]
        da, ma = _mean(a for a, _ in pairs), _mean(b for _, b in pairs)
        out[f"n_by_{suffix}"][key] = len(pairs)
        out[f"accuracy_by_{suffix}"][key] = ma
        out["dense_accuracy_same_turns_by_position" if suffix == "position" else "dense_accuracy_by_length"][key] = da
        out[f"accuracy_ratio_by_{suffix}"][key] = _ratio(ma, da)
        if da is not None and da < DENSE_FLOOR:
            out["dense_below_floor"].append(key)
        if suffix == "position":
            out["paired_ci95_by_position"][key] = paired_diff_ci(pairs)

    for pos in POSITIONS:
        cell([t for t in ids if d[t]["task_position"] == pos], "position", pos)
    for name, _ in LENGTH_BUCKETS:
        sel = [t for t in ids if bucket_of(d[t].get("prompt_tokens")) == name]
        cell(sel, "length", name)
        eng = engaged([m[t] for t in sel], mode)["engaged_fraction"] if sel else None
        out["engaged_fraction_by_length"][name] = eng
        if sel and not eng:
            out["dense_at_length"].append(name)
    kinds = sorted({d[t]["kind"] for t in ids})
    out["accuracy_by_kind"] = {k: _mean(float(m[t]["score"]) for t in ids if d[t]["kind"] == k) for k in kinds}
    out["dense_accuracy_by_kind_same_turns"] = {k: _mean(float(d[t]["score"]) for t in ids if d[t]["kind"] == k)
                                                for k in kinds}
    kept = [s.get("kv_kept_ratio") for s in (_summary(m[t]) for t in ids) if s.get("kv_kept_ratio") is not None]
    if kept:
        out["kv_kept_ratio_mean"] = _mean(kept)
    out.update(engaged([m[t] for t in ids], mode))
    same = [d[t].get("token_ids") == m[t].get("token_ids") for t in ids]
    out["output_agreement"] = _mean(float(x) for x in same)
    out["documents_api_turns"] = sum(1 for t in ids if m[t].get("documents_api"))
    out["failed_tasks"] = sum(1 for t in other.get("tasks", []) if t.get("error"))
    return out


def dense_figures(dense: dict, preset) -> dict:
    rows = report.headline_rows(dense, preset)
    by_pos = {p: _mean(float(r["score"]) for r in rows if r["task_position"] == p) for p in POSITIONS}
    by_len = {n: _mean(float(r["score"]) for r in rows if bucket_of(r.get("prompt_tokens")) == n)
              for n, _ in LENGTH_BUCKETS}
    by_kind: dict = {}
    for r in rows:
        by_kind.setdefault(r["kind"], {}).setdefault(r["task_position"], []).append(float(r["score"]))
    return {"dense_accuracy_by_position": by_pos, "dense_accuracy_by_length": by_len,
            "dense_accuracy_by_kind": {k: {p: _mean(v.get(p, [])) for p in POSITIONS} for k, v in by_kind.items()},
            "dense_turns": len(rows),
            "dense_below_floor": [p for p, v in {**by_pos, **by_len}.items() if v is not None and v < DENSE_FLOOR]}


def load_run(run_dir: Path) -> tuple[dict, dict, object]:
    run = json.loads((run_dir / "run.json").read_text())
    preset = tasks.PRESETS[run["preset"]]
    results = {}
    for mode in run["modes"]:
        f = run_dir / "raw" / f"{mode}.json"
        if f.is_file():
            results[mode] = json.loads(f.read_text())
    return run, results, preset


def fidelity_long(run_dir: Path) -> dict:
    """The fidelity_long.json dict of a harness run directory."""
    run, results, preset = load_run(run_dir)
    if not results.get("off", {}).get("tasks"):
        raise SystemExit(f"error: {run_dir} has no completed 'off' (dense) record")
    meta = run["meta"]
    out = {"gpu": meta.get("gpu", "none"), "model": meta.get("model_name", ""), "preset": run["preset"],
           "command": meta.get("command"), "length_buckets": {n: hi for n, hi in LENGTH_BUCKETS},
           "dense_floor": DENSE_FLOOR, "modes": {}, "errors": run.get("errors", {}),
           "engaged_fraction_note": "decode steps for psa/lastwindow, prompt tokens of assembled requests for samkv, "
                                    "the mean of the prefill-token and decode-step shares for loopserve"}
    out.update(dense_figures(results["off"], preset))
    for mode, rec in results.items():
        if mode == "off" or not rec.get("tasks"):
            continue
        out["modes"][mode] = mode_figures(results["off"], rec, mode, preset)
        cfg = ((rec.get("server") or {}).get("reported") or {}).get("config")
        if cfg:  # the config the server ran (bench.mode_settings labels rows not at today's defaults)
            out.setdefault("mode_configs", {})[mode] = cfg
    return out


def _f(x, nd=2):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(fid: dict) -> str:
    md = ["# Fidelity on the long-context testbed", "",
          f"- GPU: {fid['gpu']}; model: {fid['model']}; preset `{fid['preset']}`",
          f"- command: `{fid.get('command')}`",
          f"- position = question position in the turn (needle: depth 10 / 50 / 90 %); lengths bucket the scored "
          f"request's prompt tokens: {', '.join(f'{n} <= {h}' for n, h in fid['length_buckets'].items() if h < 1 << 30)}, "
          f"32k above; cells where dense is below {fid['dense_floor']} are marked `(!)`", "",
          "| mode | turns | begin | middle | end | 8k | 16k | 32k | diff CI95 begin / middle / end (points) | "
          "engaged | output agreement |", "|" + "---|" * 11]
    dp, dl = fid["dense_accuracy_by_position"], fid["dense_accuracy_by_length"]
    flag = lambda v: " (!)" if v is not None and v < fid["dense_floor"] else ""  # noqa: E731
    md.append(f"| off (dense accuracy) | {fid['dense_turns']} | " + " | ".join(f"{_f(dp[p])}{flag(dp[p])}" for p in POSITIONS)
              + " | " + " | ".join(f"{_f(dl[n])}{flag(dl[n])}" for n, _ in LENGTH_BUCKETS) + " | - | - | - |")
    for mode, m in fid["modes"].items():
        ci = " / ".join("n/a" if m["paired_ci95_by_position"][p] is None else
                        f"[{m['paired_ci95_by_position'][p][0]:+.1f}, {m['paired_ci95_by_position'][p][1]:+.1f}]"
                        for p in POSITIONS)
        lens = " | ".join(("dense at this length" if n in m["dense_at_length"] else _f(m["accuracy_ratio_by_length"][n]))
                          for n, _ in LENGTH_BUCKETS)
        md.append(f"| {mode} (ratio to dense) | {m['scored_turns']} | "
                  + " | ".join(_f(m["accuracy_ratio_by_position"][p]) for p in POSITIONS)
                  + f" | {lens} | {ci} | {_f(m['engaged_fraction'])} (prefill {_f(m['engaged_prefill_fraction'])}, "
                  f"decode {_f(m['engaged_decode_fraction'])}) | {_f(m['output_agreement'])} |")
    md += ["", "## Dense accuracy by task kind and position", "", "| kind | begin | middle | end |", "|---|---|---|---|"]
    for k, v in fid["dense_accuracy_by_kind"].items():
        md.append(f"| {k} | " + " | ".join(_f(v[p]) for p in POSITIONS) + " |")
    if fid.get("errors"):
        md += ["", "## Errors", ""] + [f"- `{m}`: {e}" for m, e in fid["errors"].items()]
    return "\n".join(md) + "\n"


def needle_table(run_dir: Path) -> dict:
    """Dense needle retrieval by haystack length (target tokens) and depth, from an ``off`` run."""
    run, results, preset = load_run(run_dir)
    rec = results.get("off") or {}
    cells: dict = {}
    for t in rec.get("tasks", []):
        if t["kind"] != "needle_depth" or not t["turns"]:
            continue
        x = t["turns"][-1]
        c = cells.setdefault(str(t["tokens"]), {}).setdefault(t["position"], {"n": 0, "right": 0, "prompt": []})
        c["n"] += 1
        c["right"] += float(x["score"])
        c["prompt"].append(x.get("prompt_tokens") or 0)
    table = {k: {tasks_long_depth(p): {"n": c["n"], "accuracy": c["right"] / c["n"] if c["n"] else None,
                                       "mean_prompt_tokens": _mean(c["prompt"])}
                 for p, c in sorted(v.items(), key=lambda kv: POSITIONS.index(kv[0]))}
             for k, v in sorted(cells.items(), key=lambda kv: int(kv[0]))}
    meta = run["meta"]
    return {"gpu": meta.get("gpu", "none"), "model": meta.get("model_name", ""), "preset": run["preset"],
            "command": meta.get("command"), "extra_server_args": meta.get("extra server args"),
            "failed_tasks": sum(1 for t in rec.get("tasks", []) if t.get("error")),
            "by_length_and_depth": table}


def tasks_long_depth(position: str) -> str:
    from bench.tasks_long import DEPTHS
    return f"{int(round(100 * DEPTHS[position]))}%"


def needle_markdown(tab: dict) -> str:
    depths = [tasks_long_depth(p) for p in POSITIONS]
    md = [f"# Dense needle retrieval: {tab['model']} ({tab['preset']})", "",
          f"- GPU: {tab['gpu']}; command: `{tab.get('command')}`; failed tasks: {tab['failed_tasks']}", "",
          "| haystack tokens | mean prompt tokens | " + " | ".join(f"depth {d}" for d in depths) + " | n per cell |",
          "|" + "---|" * (3 + len(depths))]
    for k, v in tab["by_length_and_depth"].items():
        prompts = [c["mean_prompt_tokens"] for c in v.values() if c["mean_prompt_tokens"]]
        md.append(f"| {k} | {_f(_mean(prompts), 0)} | " + " | ".join(_f((v.get(d) or {}).get("accuracy")) for d in depths)
                  + f" | {min(c['n'] for c in v.values())} |")
    return "\n".join(md) + "\n"


def _write(path: Path, doc: dict, md: str) -> None:
    """``doc`` as JSON at ``path`` and its markdown beside it (``.md``)."""
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="harness run dir of a long preset (off + modes)")
    p.add_argument("--json", default=None, help="write fidelity_long.json here (and a .md beside it)")
    p.add_argument("--psa-json", default=None, help="also rewrite psa_fidelity.json from the same run")
    p.add_argument("--loopserve-json", default=None, help="also rewrite loopserve_fidelity.json from the same run")
    p.add_argument("--needle-run", help="harness run dir of the needle_table preset (off)")
    p.add_argument("--needle-json", default=None, help="write the needle table JSON here (and a .md beside it)")
    a = p.parse_args(argv)
    if not a.run and not a.needle_run:
        p.error("give --run and/or --needle-run")
    if a.run:
        fid = fidelity_long(Path(a.run))
        md = markdown(fid)
        print(md)
        if a.json:
            _write(Path(a.json), fid, md)
        summary = json.loads((Path(a.run) / "summary.json").read_text())
        if a.psa_json and "psa" in summary["modes"]:
            from bench.psa_fidelity import fidelity_figures
            Path(a.psa_json).write_text(json.dumps(fidelity_figures(summary, "psa"), indent=1,
                                                   default=lambda x: None) + "\n")
        if a.loopserve_json and "loopserve" in summary["modes"]:
            from bench.loopserve_fidelity import loopserve_figures
            Path(a.loopserve_json).write_text(json.dumps(loopserve_figures(summary), indent=1,
                                                         default=lambda x: None) + "\n")
    if a.needle_run:
        tab = needle_table(Path(a.needle_run))
        md = needle_markdown(tab)
        print(md)
        if a.needle_json:
            _write(Path(a.needle_json), tab, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
