"""Aggregate per-mode raw records into the markdown report, PNG plots and the
``baseline_dense.json`` headline file.

Inputs are the JSON-able records of :func:`bench.harness.run_mode`, one per mode
(``off`` is the baseline every other mode is compared with), plus run metadata.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from bench import scoring
from bench.tasks import HEADLINE_MAX_WORDS, POSITIONS, Preset


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def last_turns(rec: dict) -> list[dict]:
    """The scored (last) turn of every completed task, with the task's fields."""
    out = []
    for t in rec.get("tasks", []):
        if t["turns"]:
            out.append({**t["turns"][-1], "kind": t["kind"], "words": t["words"], "docs": t["docs"],
                        "task_id": t["task_id"], "task_position": t["position"], "n_turns": len(t["turns"])})
    return out


def scored_turns(rec: dict) -> list[dict]:
    """Every turn of every completed task as a scored item (long presets): ``task_id`` is
    ``<task>#<turn>`` so pairing across modes matches turn by turn."""
    out = []
    for t in rec.get("tasks", []):
        for x in t["turns"]:
            out.append({**x, "kind": t["kind"], "words": t["words"], "docs": t["docs"], "tokens": t.get("tokens"),
                        "depth": t.get("depth"), "task_id": f"{t['task_id']}#{x['turn']}",
                        "task_position": t["position"], "n_turns": len(t["turns"])})
    return out


def headline_rows(rec: dict, preset: Preset) -> list[dict]:
    """The scored turns of the headline tasks: the accuracy kinds at validated (short) lengths; for a
    long preset every turn of every task of its kinds (:func:`scored_turns`)."""
    if preset.long:
        return [r for r in scored_turns(rec) if r["kind"] in preset.accuracy_kinds]
    return [r for r in last_turns(rec) if r["kind"] in preset.accuracy_kinds and r["words"] <= HEADLINE_MAX_WORDS]


def headline(rec: dict, preset: Preset) -> dict:
    """accuracy_by_position over :func:`headline_rows`."""
    rows = headline_rows(rec, preset)
    acc = {p: _mean(r["score"] for r in rows if r["task_position"] == p) for p in POSITIONS}
    return {"tasks": len(rows), "accuracy_by_position": acc}


def by_kind(rec: dict) -> list[dict]:
    """One row per (kind, words, docs): task count, EM/F1/Rouge-L and score by position."""
    groups: dict[tuple, list[dict]] = {}
    for r in last_turns(rec):
        groups.setdefault((r["kind"], r["words"], r["docs"], r["n_turns"]), []).append(r)
    rows = []
    for (kind, words, docs, n_turns), rs in groups.items():
        row = {"kind": kind, "words": words, "docs": docs, "turns": n_turns, "n": len(rs), "metric": rs[0]["metric"],
               "em": _mean(r["em"] for r in rs), "f1": _mean(r["f1"] for r in rs),
               "rouge_l": _mean(r["rouge_l"] for r in rs),
               "prompt_tokens": _mean(r["prompt_tokens"] for r in rs)}
        for p in POSITIONS:
            row[p] = _mean(r["score"] for r in rs if r["task_position"] == p)
        rows.append(row)
    return rows


def fidelity(dense: dict, other: dict) -> dict:
    """Fidelity of ``other`` against ``dense`` on identical prompts."""
    d_turns = {(t["task_id"], x["turn"]): x for t in dense.get("tasks", []) for x in t["turns"]}
    agree = []
    for t in other.get("tasks", []):
        for x in t["turns"]:
            ref = d_turns.get((t["task_id"], x["turn"]))
            if ref is not None:
                agree.append(scoring.greedy_agreement(ref["token_ids"], x["token_ids"]))
    g128, tops_d, tops_o = [], [], []
    for a, b in zip(dense.get("fidelity", []), other.get("fidelity", [])):
        if a.get("error") or b.get("error"):
            continue
        g128.append(scoring.greedy_agreement(a["output_ids"], b["output_ids"]))
        tops_d += a["top"]
        tops_o += b["top"]
    tf = scoring.kl_top1(tops_d, tops_o)
    return {"reply_prefix": _mean(a["prefix"] for a in agree), "reply_exact": _mean(a["exact"] for a in agree),
            "greedy128_prefix": _mean(a["prefix"] for a in g128),
            "greedy128_positional": _mean(a["positional"] for a in g128),
            "greedy128_exact": _mean(a["exact"] for a in g128), "tf_positions": tf["positions"],
            "top1": tf["top1"], "kl": tf["kl"], "kl_max": tf["kl_max"], "kept_mass": kept(other)}


def kept(rec: dict) -> float:
    """Mean kept attention mass the mode reported (NaN = not reported)."""
    xs = [x.get("kept_mass") for t in rec.get("tasks", []) for x in t["turns"]]
    xs += [f.get(k) for f in rec.get("fidelity", []) for k in ("kept_mass", "kept_mass_tf")]
    return _mean(xs)


def latency(rec: dict) -> dict:
    turns = [x for t in rec.get("tasks", []) for x in t["turns"]]
    lat = [x["latency_s"] for x in turns]
    pt = [x["prompt_tokens"] or 0 for x in turns]
    ct = [x["cached_tokens"] or 0 for x in turns]
    later = [(x["cached_tokens"] or 0) / max(1, x["prompt_tokens"] or 1) for x in turns if x["turn"] > 0]
    fl = [f["greedy_latency_s"] for f in rec.get("fidelity", []) if not f.get("error")]
    return {"turns": len(turns), "mean_s": _mean(lat), "median_s": statistics.median(lat) if lat else float("nan"),
            "p90_s": sorted(lat)[int(0.9 * (len(lat) - 1))] if lat else float("nan"),
            "prompt_tokens": _mean(pt), "cached_frac": sum(ct) / max(1, sum(pt)),
            "cached_frac_later_turns": _mean(later), "greedy128_s": _mean(fl),
            "tasks_wall_s": rec.get("tasks_wall_s"), "startup_s": rec.get("startup_s")}


# ---------------------------------------------------------------- plots

def plot_accuracy(results: dict, preset: Preset, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m, r in results.items() if r.get("tasks")]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        acc = headline(results[m], preset)["accuracy_by_position"]
        ax.bar([j + i * w for j in range(len(POSITIONS))], [0 if math.isnan(acc[p]) else acc[p] for p in POSITIONS],
               w, label=m)
    ax.set_xticks([j + w * (len(modes) - 1) / 2 for j in range(len(POSITIONS))], POSITIONS)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("question position in the turn")
    ax.set_ylabel("accuracy (last turn)")
    ax.set_title("Accuracy by question position and --sparse mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, r in results.items():
        turns = [x for t in r.get("tasks", []) for x in t["turns"]]
        if turns:
            ax.scatter([x["prompt_tokens"] or 0 for x in turns], [1000 * x["latency_s"] for x in turns],
                       s=8, alpha=0.6, label=m)
    ax.set_xlabel("prompt tokens (whole conversation so far)")
    ax.set_ylabel("request latency (ms)")
    ax.set_title("Per-turn chat latency by --sparse mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- markdown

def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, results: dict, preset: Preset, meta: dict, errors: dict,
                 baseline_json: Path | None = None) -> Path:
    """Write report.md, accuracy_by_position.png, latency.png, summary.json (and the
    headline ``baseline_json``, default ``out_dir/baseline_dense.json``, when the dense
    run completed). Returns the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {m: r for m, r in results.items() if r.get("tasks")}
    plot_note = ""
    if done:
        try:
            plot_accuracy(done, preset, out_dir / "accuracy_by_position.png")
            plot_latency(done, out_dir / "latency.png")
        except ImportError as e:  # e.g. a GPU image without matplotlib: rerender later
            plot_note = (f"(plots not rendered here: {e}; rebuild them elsewhere with "
                         f"`python -m bench.run_harness --rerender <this dir>`)")
    md = [f"# Multi-turn long-context harness: preset `{preset.name}`", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()]
    md += ["", "## Headline accuracy by question position",
           (f"Every turn of the {', '.join(preset.accuracy_kinds)} tasks (needle: position = depth 10/50/90 %)."
            if preset.long else
            f"Last turn of the {', '.join(preset.accuracy_kinds)} tasks at <= {HEADLINE_MAX_WORDS} words per "
            "turn/document (lengths where dense SmolLM2-135M is reliable)."), ""]
    rows = []
    summary = {"meta": meta, "modes": {}, "errors": errors}
    for m, r in results.items():
        h = headline(r, preset)
        summary["modes"][m] = {"headline": h, "by_kind": by_kind(r), "latency": latency(r) if r.get("tasks") else None,
                               "server": r.get("server")}
        rows.append([m, h["tasks"]] + [_fmt(h["accuracy_by_position"][p]) for p in POSITIONS])
    md += [_table(["mode", "tasks", *POSITIONS], rows), "", plot_note or "![accuracy](accuracy_by_position.png)", ""]
    md += ["## Scores by task kind (last turn; score = the kind's metric)", ""]
    rows = []
    for m, r in results.items():
        for k in by_kind(r):
            rows.append([m, k["kind"], k["words"], k["docs"] or "", k["turns"], k["n"], _fmt(k["prompt_tokens"], 0),
                         k["metric"], _fmt(k["em"]), _fmt(k["f1"]), _fmt(k["rouge_l"]),
                         *[_fmt(k[p]) for p in POSITIONS]])
    md += [_table(["mode", "kind", "words", "docs", "turns", "n", "prompt tok", "metric", "EM", "F1", "Rouge-L",
                   *POSITIONS], rows), ""]
    md += ["## Fidelity against dense (`off`) on the same prompts", "",
           "reply: greedy task replies (<= max_tokens); greedy128: 128-token greedy continuation of raw "
           "corpus text; top-1 / KL: teacher-forced over the real next paragraph, KL(dense||mode) estimated "
           f"from top-{20} logprobs; kept mass: as reported by the mode (`meta_info.sparse.kept_mass`). "
           "Teacher-forced positions go through the prefill (extend) path, greedy outputs through decode: "
           "a decode-only sparse mode shows its difference in the greedy columns.", ""]
    rows = []
    if "off" in done:
        for m, r in done.items():
            if m == "off":
                continue
            f = fidelity(done["off"], r)
            summary["modes"][m]["fidelity"] = f
            rows.append([m, _fmt(f["reply_prefix"]), _fmt(f["reply_exact"]), _fmt(f["greedy128_prefix"]),
                         _fmt(f["greedy128_positional"]), f["tf_positions"], _fmt(f["top1"], 3), _fmt(f["kl"], 4),
                         _fmt(f["kl_max"], 3), _fmt(f["kept_mass"], 3)])
        km = kept(done["off"])
        rows.insert(0, ["off (baseline)", "1.00", "1.00", "1.00", "1.00", "-", "1.000", "0.0000", "0.000",
                        _fmt(km, 3)])
    md += [_table(["mode", "reply prefix agr", "reply exact", "greedy128 prefix agr", "greedy128 positional",
                   "TF positions", "top-1 agr", "KL mean", "KL max", "kept mass"], rows), ""]
    md += ["## Latency", "", f"Task conversations run {meta.get('task concurrency', 1)} at a time (turns of one "
           "conversation in order); multi-turn tasks are real conversations, so later turns hit the radix cache. "
           "greedy128: one request at a time.", ""]
    rows = []
    for m, r in done.items():
        lt = latency(r)
        rows.append([m, lt["turns"], _fmt(lt["prompt_tokens"], 0), _fmt(1000 * lt["mean_s"], 1),
                     _fmt(1000 * lt["median_s"], 1), _fmt(1000 * lt["p90_s"], 1), _fmt(lt["cached_frac_later_turns"]),
                     _fmt(1000 * lt["greedy128_s"], 1), _fmt(lt["tasks_wall_s"], 1), _fmt(lt["startup_s"], 0)])
    md += [_table(["mode", "turns", "mean prompt tok", "mean ms", "median ms", "p90 ms", "cached frac (turn>1)",
                   "greedy128 ms", "tasks wall s", "server start s"], rows), "", plot_note or "![latency](latency.png)", ""]
    md += ["## Servers", ""]
    for m, r in results.items():
        md.append(f"- `{m}`: {json.dumps(r.get('server'))}")
    if errors:
        md += ["", "## Errors", ""] + [f"- `{m}`: {e}" for m, e in errors.items()]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if "off" in done:
        h = headline(done["off"], preset)
        Path(baseline_json or out_dir / "baseline_dense.json").write_text(json.dumps({
            "gpu": meta.get("gpu", "none"), "model": meta.get("model_name", ""), "dtype": meta.get("dtype", ""),
            "tasks": h["tasks"], "accuracy_by_position": {p: (None if math.isnan(v) else round(v, 4))
                                                          for p, v in h["accuracy_by_position"].items()}},
            indent=1) + "\n")
    return path
