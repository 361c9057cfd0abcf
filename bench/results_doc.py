"""Generate ``docs/results.md`` from the headline JSONs in ``bench/results/`` (tables + the PNGs).

    python -m bench.results_doc [--results bench/results] [--out docs/results.md]

Every number is read from a JSON written by a benchmark; a missing file is named as missing, never filled in.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench.mode_settings import mode_label

REPO = Path(__file__).resolve().parent.parent
POSITIONS = ("begin", "middle", "end")
LENGTHS = ("8k", "16k", "32k")


def _load(results: Path, name: str) -> dict | None:
    p = results / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _f(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def fidelity_section(fid: dict | None) -> list[str]:
    md = ["## Fidelity on the 32k testbed (`fidelity_long.json`)", ""]
    if not fid:
        return md + ["(missing: run the `long` preset and `bench.report_long`)", ""]
    floor = fid.get("dense_floor", 0.3)
    mark = lambda v: f"{_f(v)}{' (!)' if isinstance(v, (int, float)) and v < floor else ''}"  # noqa: E731
    md += [f"GPU: {fid.get('gpu')}; model: {fid.get('model')}; preset `{fid.get('preset')}`. Ratios are mode / dense "
           f"accuracy on the same scored turns; `(!)` marks cells where dense itself is below {floor}; "
           "the interval is the paired 95 % bootstrap interval of the difference in points; "
           "\"dense\" = the mode's defaults did not engage at that length.", ""]
    dp, dl = fid.get("dense_accuracy_by_position", {}), fid.get("dense_accuracy_by_length", {})
    rows = [["off (dense accuracy)", *[mark(dp.get(p)) for p in POSITIONS], *[mark(dl.get(n)) for n in LENGTHS],
             "-", "-", "-"]]
    for mode, m in fid.get("modes", {}).items():
        ci = m.get("paired_ci95_by_position", {})
        rows.append([mode_label(fid, mode), *[_f(m["accuracy_ratio_by_position"].get(p)) for p in POSITIONS],
                     *[("dense" if n in m.get("dense_at_length", []) else _f(m["accuracy_ratio_by_length"].get(n)))
                       for n in LENGTHS],
                     " / ".join("n/a" if not ci.get(p) else f"[{ci[p][0]:+.1f}, {ci[p][1]:+.1f}]" for p in POSITIONS),
                     _f(m.get("engaged_fraction")), _f(m.get("output_agreement"))])
    md += _table(["mode", *POSITIONS, *LENGTHS, "diff CI95 (points)", "engaged", "output agreement"], rows)
    errors = fid.get("errors") or {}
    if errors:
        md += ["", "Modes that did not finish: " + "; ".join(f"`{m}`: {e[:160]}" for m, e in errors.items())]
    return md + ["", "Details: [bench/results/fidelity_long.md](../bench/results/fidelity_long.md).", ""]


def e2e_section(e2e: dict | None) -> list[str]:
    md = ["## Serving load on the testbed (`e2e_long.json`)", ""]
    if not e2e:
        return md + ["(missing: run `python -m bench.load` on the testbed)", ""]
    md += [f"GPU: {e2e.get('gpu')}; model: {e2e.get('model')}; output {e2e.get('output_len')} tokens; ratios are "
           "mode / stock `off` in the same cell, measured in the same `bench.load` invocation (throughput > 1 and "
           "TTFT / TPOT < 1 are better). Invocations marked `--order interleaved` ran each cell on `off` and the "
           "mode back to back; the others ran all of `off`'s cells first (`--order by-mode`), so a drift of the "
           "machine falls on one side. At their defaults psa and loopserve are dormant on the testbed (their "
           "`min_context` is above the longest sequence a request can reach there, so nothing of them is installed): "
           "their cells are stock servers, and their spread around 1.0 is the grid's noise between server processes "
           "of identical code. Single cells swing by +-15 % between passes on the same machine at concurrency 8 and "
           "32 and by more at 1 (`e2e_long.md`: invocation N; the rotating A/Bs `ab_rounds_4k_dormant.md` and "
           "`ab_rounds_4k_pinned.md`; psa installed and probing: `ab_rounds_16k_psa_probe.md`).", ""]
    if e2e.get("mode_sources"):
        md += ["Where each mode comes from (each invocation has its own `off`):", ""]
        md += [f"- `{m}`: {src}" for m, src in e2e["mode_sources"].items()]
        for m, cells in (e2e.get("cell_sources") or {}).items():
            for src in sorted(set(cells.values())):
                md.append(f"- `{m}` cells {', '.join(sorted(k for k, v in cells.items() if v == src))}: {src}")
        md += [""]
    md += _table(["mode", "input_concurrency", "throughput", "TTFT", "TPOT", "mode tok/s"], _load_rows(e2e))
    return md + ["", "Details: [bench/results/e2e_long.md](../bench/results/e2e_long.md).", ""]


def _load_rows(e2e: dict) -> list[list]:
    """One row per (mode other than off, cell) of a ``bench.load`` e2e JSON: ratios to off and the mode's tok/s."""
    rows = []
    for mode, cells in e2e.get("modes", {}).items():
        if mode == "off":
            continue
        for key, c in cells.items():
            if not isinstance(c, dict) or "throughput_ratio_vs_off" not in c:
                continue
            if c.get("kv_pool_limited"):  # requests queued for KV memory: no comparison
                lim = "KV pool of " + ", ".join(c["kv_pool_limited"]) + " too small"
                rows.append([mode_label(e2e, mode), key, lim, "-", "-", _f(c.get("output_throughput_tok_s"), 0)])
                continue
            rows.append([mode_label(e2e, mode), key, _f(c.get("throughput_ratio_vs_off")),
                         _f(c.get("ttft_ratio_vs_off")),
                         _f(c.get("tpot_ratio_vs_off")), _f(c.get("output_throughput_tok_s"), 0)])
    return rows


def decode_only_ceiling_rows(e2e: dict) -> list[list]:
    """Per stock ``off`` cell of a ``bench.load`` e2e JSON: how much a mode that sparsifies decode alone could gain.

    The cell's wall time is ``num_prompts * output_len / output tok/s`` (every request generates ``output_len``
    tokens: the grid ignores EOS); its prefills alone take ``num_prompts`` x the mean TTFT of the same input length at
    concurrency 1 (one request alone: its prefill, nothing queued). A decode that cost nothing leaves at least the
    prefills, so ``wall / prefills`` bounds the throughput ratio of any decode-only mode in that cell. Cells without a
    concurrency-1 cell of their input length, or without the fields, are skipped."""
    off, out = e2e.get("modes", {}).get("off", {}), e2e.get("output_len")
    if not isinstance(out, (int, float)) or out <= 0:
        return []
    alone_by_input = {c.get("input_len"): c for c in off.values() if c.get("concurrency") == 1}
    rows = []
    for key, c in off.items():
        alone = alone_by_input.get(c.get("input_len"))
        try:
            wall = c["num_prompts"] * out / c["output_throughput_tok_s"]
            prefills = c["num_prompts"] * alone["mean_ttft_ms"] / 1000.0
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        if wall > 0 and prefills > 0:
            share = f"{100 * min(prefills / wall, 1.0):.0f} %"
            rows.append([key, _f(wall), _f(prefills), share, _f(max(wall / prefills, 1.0))])
    return rows


def decode_only_ceiling_section(e2e: dict | None) -> list[str]:
    rows = decode_only_ceiling_rows(e2e or {})
    if not rows:
        return []
    md = ["### What a decode-only mode can gain at most (stock `off` cells of `e2e_long.json`)", "",
          "psa, lastwindow, and loopserve with its default dense prefill, sparsify decode only: the prefills stay "
          "dense. Here a cell's prefills are its requests x one request's TTFT alone (the same input at concurrency "
          "1), and the ceiling is the cell's wall time over them: the throughput ratio that a decode costing nothing "
          "would reach. It is an estimate, not a strict bound: prompts prefilled together can run a little faster "
          "than alone (most at 4k; a 32k prompt already fills SGLang's prefill chunks on its own).", ""]
    md += _table(["input_concurrency", "stock wall s", "prefills alone s", "prefill share", "decode-only ceiling"], rows)
    return md + [""]


def samkv_plain_section(e2e: dict | None) -> list[str]:
    """samkv at its defaults on plain requests (no documents) against off, one ``bench.load`` run
    (``samkv_plain_load.json``): the e2e table's samkv rows ran under other settings."""
    md = ["### samkv at its defaults, plain requests (`samkv_plain_load.json`)", ""]
    if not e2e:
        return md + ["(missing: run `TESTBED_MODES=off,samkv scripts/gpu/testbed.sh e2e`)", ""]
    md += [f"GPU: {e2e.get('gpu')}; model: {e2e.get('model')}; one `bench.load` invocation, samkv against its own "
           "`off` cell by cell; requests without `documents` (the RAG path is measured in the SamKV section).", ""]
    md += _table(["mode", "input_concurrency", "throughput", "TTFT", "TPOT", "mode tok/s"], _load_rows(e2e))
    return md + ["", "Details: [bench/results/samkv_plain_load.md](../bench/results/samkv_plain_load.md).", ""]


def reliability_section(r: dict | None) -> list[str]:
    md = ["## Reliability (`reliability.json`)", ""]
    if not r:
        return md + ["(missing: run `python -m bench.soak` and `python -m bench.faults`, then `python -m bench.reliability`)",
                     ""]
    secs = sum((d or {}).get("seconds") or 0 for d in (r.get("soak_details") or {}).values())  # modes, not the repeat
    md += [f"GPU: {r.get('gpu')}. Soak (`bench.soak`, every mode at its defaults unless its row names its settings, "
           f"{secs:.0f} s of traffic in all); "
           f"faults (`bench.faults`): {r.get('faults_survived')} of {r.get('faults_tried')} survived.", ""]
    rows = [[mode_label(r, m),
             *(str(x.get(k)) for k in ("sent", "completed", "aborted", "failed", "wrong_vs_off", "http_5xx")),
             _f(x.get("rss_slope_mb_per_1k_requests"), 1), str(x.get("idle_leak_check"))]
            for m, x in (r.get("modes") or {}).items()]
    md += _table(["mode", "sent", "completed", "aborted", "failed", "wrong vs off", "5xx", "RSS slope MB / 1k requests",
                  "idle leak check"], rows)
    runs = r.get("mode_runs") or {}
    if len(set(runs.values())) > 1:  # modes soaked under other server arguments, each against its own run's off
        by = {}
        for m, lab in runs.items():
            by.setdefault(lab, []).append(f"`{m}`")
        md += ["", "Soak runs, each mode against the `off` server of its own run: "
               + "; ".join(f"{', '.join(ms)} with `{lab}`" for lab, ms in by.items()) + "."]
    noise = r.get("noise_floor_off_repeat")
    if noise:
        md += ["", f"Noise floor{' (' + noise['run'] + ' run)' if noise.get('run') and len(set(runs.values())) > 1 else ''}: a second `off` run of the same traffic answered {noise.get('wrong_vs_off')} facts wrong "
               f"that the first answered right and {noise.get('right_where_off_wrong')} right that it answered wrong "
               f"({noise.get('facts_checked')} checked); read `wrong vs off` against it (facts checked per mode and "
               "the other direction are in the details)."]  # a mode's own reading is in its note, below
    for mode, note in (r.get("notes") or {}).items():
        md += ["", f"`{mode}`: {note}"]
    return md + ["", "Details: [bench/results/reliability.md](../bench/results/reliability.md).", ""]


def needle_section(tab: dict | None, title: str) -> list[str]:
    md = [f"## {title}", ""]
    if not tab:
        return md + ["(missing)", ""]
    md += [f"GPU: {tab.get('gpu')}; model: {tab.get('model')}; dense (`off`), question last.", ""]
    rows = []
    for length, cells in tab.get("by_length_and_depth", {}).items():
        rows.append([length, *[f"{_f((cells.get(d) or {}).get('accuracy'))} (n={(cells.get(d) or {}).get('n', 0)})"
                               for d in ("10%", "50%", "90%")]])
    return md + _table(["haystack tokens", "depth 10 %", "depth 50 %", "depth 90 %"], rows) + [""]


def kernel_section(psa: dict | None, ls: dict | None) -> list[str]:
    md = ["## Kernels (planted structure: kernel speed only, no default is chosen from these)", ""]
    rows = []
    if psa:
        rows.append(["PSA decode vs FlashInfer dense, 128k, batch 8, eps 0.95", _f(psa.get("speedup_128k_b8_eps095")),
                     f"fraction of the bytes-read limit {_f(psa.get('fraction_of_bytes_limit'))}"])
    if ls:
        rows.append(["LoopServe sparse prefill vs FlashInfer dense, 128k", _f(ls.get("speedup_128k")),
                     f"32k {_f(ls.get('speedup_32k'))}, 4k {_f(ls.get('speedup_4k'))}"])
    md += _table(["kernel", "speedup", "also"], rows) if rows else ["(missing)"]
    for png in ("psa_decode.png", "loopserve_prefill.png"):
        md += ["", f"![{png}](../bench/results/{png})"]
    return md + [""]


def samkv_section(s: dict | None) -> list[str]:
    md = ["## SamKV (`samkv.json`)", ""]
    if not s:
        return md + ["(missing)", ""]
    keys = ("baseline", "accuracy_delta_vs_stock_inline", "ttft_ratio_vs_stock_inline", "accuracy_delta_vs_recompute",
            "ttft_ratio_vs_recompute", "kv_kept_ratio")
    rows = [[k, _f(s.get(k)) if not isinstance(s.get(k), str) else s.get(k)] for k in keys if k in s]
    md += _table(["figure", "value"], rows)
    src = s.get("figure_sources") or {}
    md += [""] + [f"- `{k}`: {src[k]}" for k in keys if src.get(k)]
    v = s.get("accuracy_vs_stock_inline")
    if v:
        md += ["", f"Every variant against the stock inline prompt, same server, {v.get('tasks')} RAG tasks "
               f"(documents API kept {_f(v.get('kv_kept_ratio'))} of the document KV under `samkv`):", ""]
        rows = [[k, _f(a), _f((v.get("delta_points") or {}).get(k), 1),
                 str((v.get("delta_ci95_points") or {}).get(k) or "-")] for k, a in (v.get("accuracy") or {}).items()]
        md += _table(["request", "accuracy", "delta vs stock inline (points)", "paired 95 % interval"], rows)
    return md + ["", f"GPU: {s.get('gpu')}.", ""]


def build(results: Path) -> str:
    md = ["# Results", "",
          "Generated by `python -m bench.results_doc` from the JSONs in `bench/results/` (each names its command, "
          "GPU and versions). Fidelity headlines come from the 32k testbed at each mode's defaults; a row measured "
          "under other settings names them after the mode.", ""]
    md += fidelity_section(_load(results, "fidelity_long.json"))
    e2e = _load(results, "e2e_long.json")
    md += e2e_section(e2e)
    md += decode_only_ceiling_section(e2e)
    md += samkv_plain_section(_load(results, "samkv_plain_load.json"))
    md += needle_section(_load(results, "needle_table.json"), "Dense needle retrieval, 32k profile (`needle_table.json`)")
    md += needle_section(_load(results, "needle_table_64k.json"),
                         "Dense needle retrieval, 64k profile (`needle_table_64k.json`)")
    md += samkv_section(_load(results, "samkv.json"))
    md += reliability_section(_load(results, "reliability.json"))
    md += kernel_section(_load(results, "psa_decode.json"), _load(results, "loopserve_prefill.json"))
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(REPO / "bench" / "results"))
    p.add_argument("--out", default=str(REPO / "docs" / "results.md"))
    a = p.parse_args(argv)
    text = build(Path(a.results))
    Path(a.out).write_text(text)
    print(f"wrote {a.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
