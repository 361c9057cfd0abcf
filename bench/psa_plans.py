"""Wave plans and stage times of the PSA decode kernel (``bench/psa_decode_bench.py --wave-sweep`` /
``--stage-profile``): the planted cases and the 32k testbed capture over first-wave programs per SM, growth, wave
count and sorted prefix (:func:`run_wave_sweep`, :func:`pick_wave_plan`), and where one layer's time goes at the
defaults (:func:`run_stage_profile`). ``run_case`` is the benchmark's :func:`psa_decode_bench.run_case`, passed in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from pathlib import Path

import torch

from bench import real_capture
from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.criticality import CritTile
from flashinfer_ext.psa.decode import PsaDecodeWrapper

WAVE_SWEEP_CASES = ((8, 131072, 16), (1, 131072, 16), (32, 32768, 16))  # (batch, ctx, page); the headline first
# programs per SM of the first wave x growth x max waves x the exactly sorted prefix (blocks)
WAVE_SWEEP_GRID = [dict(wave_programs=m, wave_growth=gr, max_waves=mw, sorted_prefix_blocks=pf)
                   for m in (2, 4, 8) for gr in (2.0, 4.0, 8.0) for mw in (12, 5) for pf in (1024, 256)]
# the plan a sweep is judged against: the defaults in force (PsaDecodeWrapper / PsaDecodeConfig)
WAVE_BASE = (PsaDecodeWrapper.WAVE_PROGRAMS_PER_SM, PsaDecodeWrapper.WAVE_GROWTH, PsaDecodeWrapper.MAX_WAVES,
             PsaDecodeConfig.sorted_prefix_blocks)


# criticality launch shapes x metadata layouts (run_crit_sweep); the defaults in force first
CRIT_BASE = (PsaDecodeWrapper.META_LAYOUT, PsaDecodeWrapper.CRIT_TILE)
CRIT_SWEEP_GRID = [CRIT_BASE] + [(lay, t) for lay in ("planar", "interleaved") for t in (
    CritTile(), CritTile(tile_b=32, num_warps=4), CritTile(tile_b=16, num_warps=4), CritTile(tile_b=32, num_warps=8),
    CritTile(heads=0, elements=8192, num_warps=8), CritTile(heads=0, elements=4096, num_warps=4),
    CritTile(heads=0, elements=2048, num_warps=4), CritTile(heads=0, elements=4096, num_warps=8))
    if (lay, t) != CRIT_BASE]


def plan_kw(g: dict, sms: int) -> tuple[dict, dict]:
    """A sweep plan -> (wrapper keyword arguments, PsaDecodeConfig overrides)."""
    wkw = dict(wave_programs=g["wave_programs"] * sms, wave_growth=g["wave_growth"], max_waves=g["max_waves"])
    return wkw, {"sorted_prefix_blocks": g.get("sorted_prefix_blocks", WAVE_BASE[3])}


def real_pool(model_dir: Path, slot_tokens: dict, real_layers, dev: str, meta: dict):
    """The 32k testbed capture as a decode pool (None without the testbed folder or when the capture fails; the
    reason lands in ``meta["real_skipped"]``)."""
    if not (model_dir / "config.json").is_file():
        meta["real_skipped"] = f"no testbed model at {model_dir} (--testbed-model)"
        return None
    try:
        slot = "real_32k"
        (_, cap, info), = real_capture.testbed_captures(model_dir, {slot: slot_tokens[slot]}, tuple(real_layers), dev)
        meta["real_prompt_len"] = info["prompt_len"]
        return real_capture.decode_pool(cap, tuple(real_layers), real_capture.decode_positions(info["prompt_len"]), dev)
    except Exception as e:
        traceback.print_exc()
        meta["real_skipped"] = f"{type(e).__name__}: {e}"
        return None


def _todo(cases, real_pool) -> list:
    """``(case name, run_case keyword arguments)`` of the planted ``cases`` and, when given, the testbed capture."""
    todo = [("planted", dict(batch=b, ctx=c, page=p)) for b, c, p in cases]
    if real_pool is not None:
        todo.append((real_capture.REAL_CASE, dict(batch=0, ctx=0, page=16, planted=False, capture=real_pool)))
    return todo


def run_stage_profile(run_case, out: Path, meta: dict, dev: str, cases=WAVE_SWEEP_CASES, real_pool=None,
                      estimator: str | None = None) -> list:
    """Where a layer's time goes, at the defaults: criticality (the metadata pass), ranking, bound suffix, waves +
    merges, per planted case and the 32k testbed capture, with the fraction of the bytes limit. Writes
    ``psa_stage_profile.{json,md}`` (``psa_stage_profile_<estimator>`` with ``estimator``: that stop test's stages;
    for 'sketch' the criticality stage is the sketch's block masses and shares)."""
    rows = []
    for name, kw in _todo(cases, real_pool):
        if estimator:
            kw = dict(kw, estimator=estimator)
        try:
            r = run_case(name, dev=dev, with_topk=False, stage_profile=True, **kw)
        except Exception as e:
            traceback.print_exc()
            r = dict(case=name, batch=kw["batch"], ctx=kw["ctx"], page=kw["page"], error=f"{type(e).__name__}: {e}")
        print(json.dumps(r), flush=True)
        rows.append(r)
    out.mkdir(parents=True, exist_ok=True)
    stem = "psa_stage_profile" + (f"_{estimator}" if estimator else "")
    peak = meta.get("peak_bps") or float("nan")
    lines = ["# PSA decode: where a layer's time goes", "", f"- command: `{meta['command']}`",
             f"- device: {meta['gpu']}; peak copy bandwidth {peak / 1e12:.2f} TB/s",
             f"- versions: {meta['versions']}", f"- defaults (eps 0.95, {estimator or 'calibrated'!r} stop test, "
             f"{'sketch shares rank order' if estimator in ('sketch', 'select') else 'mean rank order'}, the wave plan of "
             "PsaDecodeWrapper); each stage = the replay time of a CUDA graph of the run cut after it, minus the one "
             "before; 'waves + merges' = the full run minus the run cut after the bound suffix; fraction of the bytes "
             "limit = (metadata + K/V the kernels read) / peak / t PSA", "",
             "| case | batch | ctx | t PSA us | criticality us | its TB/s | ranking us | bound suffix us | waves + merges us "
             "| waves | t dense us | dense / PSA | fraction of bytes limit |", "|" + "---|" * 13]
    for r in rows:
        lead = f"| {r['case']} | {r['batch']} | {r['ctx']} | "
        if "error" in r or "t_stage_us" not in r:
            lines.append(lead + f"{r.get('error', 'no GPU timing')[:120]} |" + " |" * 9)
            continue
        t = r["t_stage_us"]
        r["fraction_of_bytes_limit"] = r["psa_bytes"] / peak / (r["t_psa_us"] * 1e-6)
        lines.append(lead + f"{r['t_psa_us']:.1f} | {t['criticality']:.1f} | {r['criticality_tbps']:.2f} | "
                     f"{t['ranking']:.1f} | {t['bound_suffix']:.1f} | {t['waves_and_merges']:.1f} | {r['waves']} | "
                     f"{r['t_dense_us']:.1f} | {r['speedup']:.2f} | {r['fraction_of_bytes_limit']:.3f} |")
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return rows


def run_wave_sweep(run_case, out: Path, meta: dict, dev: str, cases=WAVE_SWEEP_CASES, grid=None, real_pool=None) -> list:
    """The planted cases (and, with ``real_pool``, the 32k testbed capture) over plans: first-wave programs per SM
    x growth x max waves x sorted prefix. Per plan: PSA time, waves, blocks the kernels read, blocks in the result
    and the fraction of the bytes-read limit. Writes ``psa_wave_sweep.{json,md}``."""
    grid = WAVE_SWEEP_GRID if grid is None else grid
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    rows = []
    for name, kw in _todo(cases, real_pool):
        for g in grid:
            wkw, ckw = plan_kw(g, sms)
            try:
                r = run_case(name, dev=dev, with_topk=False, wrapper_kw=wkw, cfg_kw=ckw, **kw)
                r.update(programs_per_sm=g["wave_programs"], sorted_prefix_blocks=ckw["sorted_prefix_blocks"])
                r["fraction_of_bytes_limit"] = r["psa_tbps"] * 1e12 / meta["peak_bps"] if meta.get("peak_bps") else None
            except Exception as e:
                traceback.print_exc()
                r = dict(case=name, batch=kw["batch"], ctx=kw["ctx"], page=kw["page"], **g, error=f"{type(e).__name__}: {e}")
            print(json.dumps(r), flush=True)
            rows.append(r)
    out.mkdir(parents=True, exist_ok=True)
    pick = pick_wave_plan(rows)
    (out / "psa_wave_sweep.json").write_text(json.dumps(dict(meta=meta, picked=pick, results=rows), indent=1))
    lines = ["# PSA decode: wave plans and sorted prefix", "", f"- command: `{meta['command']}`",
             f"- device: {meta['gpu']}; peak copy bandwidth {meta.get('peak_bps', float('nan')) / 1e12:.2f} TB/s",
             f"- versions: {meta['versions']}", "- eps 0.95, 'calibrated', page 16, bf16; planted: 32/8 heads, d 128; "
             "testbed real: the 32k testbed model's captured q/k/v (9/3 heads, d 64); t PSA = median of CUDA-graph "
             "replays of one layer",
             f"- picked (pick_wave_plan: fastest headline among plans within 3 % of the defaults {WAVE_BASE} on every "
             f"case, and reading no more blocks on the testbed capture): {pick}", "",
             "| case | batch | ctx | programs/SM | growth | max waves | prefix | waves | t PSA us | t dense us | "
             "dense/PSA | result frac | kernel frac | fraction of bytes limit |", "|" + "---|" * 14]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['batch']} | {r['ctx']} | FAILED: {r['error'][:120]} |" + " |" * 10)
            continue
        f = r.get("fraction_of_bytes_limit")
        lines.append(f"| {r['case']} | {r['batch']} | {r['ctx']} | {r['programs_per_sm']} | {r['wave_growth']:g} | "
                     f"{r['max_waves']} | {r['sorted_prefix_blocks']} | {r['waves']} | {r['t_psa_us']:.1f} | "
                     f"{r['t_dense_us']:.1f} | {r['speedup']:.2f} | {r['read_frac']:.4f} | {r['kernel_read_frac']:.4f} | "
                     f"{'-' if f is None or not math.isfinite(f) else f'{f:.3f}'} |")
    (out / "psa_wave_sweep.md").write_text("\n".join(lines) + "\n")
    return rows


def _crit_key(r: dict) -> tuple:
    t = r["crit_tile"]
    return r["meta_layout"], t["tile_b"], t["heads"], t["elements"], t["num_warps"]


def run_crit_sweep(run_case, out: Path, meta: dict, dev: str, cases=WAVE_SWEEP_CASES, grid=None,
                   real_pool=None) -> list:
    """The criticality pass (the metadata read) over launch shapes (:class:`CritTile`) x :class:`BlockMetaPool`
    layouts, at the wave plan in force: its time and TB/s (the run cut after it) and the full layer's, per planted
    case and the 32k testbed capture. Writes ``psa_crit_sweep.{json,md}`` with the :func:`pick_crit` choice."""
    grid = CRIT_SWEEP_GRID if grid is None else grid
    rows = []
    for name, kw in _todo(cases, real_pool):
        for layout, tile in grid:
            try:
                r = run_case(name, dev=dev, with_topk=False, stage_profile=True, meta_layout=layout,
                             wrapper_kw=dict(crit_tile=tile), **kw)
                r["fraction_of_bytes_limit"] = r["psa_tbps"] * 1e12 / meta["peak_bps"] if meta.get("peak_bps") else None
            except Exception as e:
                traceback.print_exc()
                r = dict(case=name, batch=kw["batch"], ctx=kw["ctx"], page=kw["page"], meta_layout=layout,
                         crit_tile=dataclasses.asdict(tile), error=f"{type(e).__name__}: {e}")
            print(json.dumps(r), flush=True)
            rows.append(r)
    out.mkdir(parents=True, exist_ok=True)
    pick = pick_crit(rows)
    (out / "psa_crit_sweep.json").write_text(json.dumps(dict(meta=meta, picked=pick, results=rows), indent=1))
    lines = ["# PSA decode: the criticality pass's launch shape and the metadata layout", "",
             f"- command: `{meta['command']}`",
             f"- device: {meta['gpu']}; peak copy bandwidth {meta.get('peak_bps', float('nan')) / 1e12:.2f} TB/s",
             f"- versions: {meta['versions']}", "- eps 0.95, 'calibrated', mean rank order, page 16, bf16 metadata (min, "
             "max, mean); the wave plan of PsaDecodeWrapper. criticality = the replay of a CUDA graph of the run cut "
             "after that pass; tile: blocks x KV heads per program (heads 0 = all), elements (auto tile_b), warps",
             f"- picked (pick_crit: fastest headline layer among shapes no slower than the defaults {CRIT_BASE[0]} / "
             f"{CRIT_BASE[1]} by more than 3 % on any case): {pick}", "",
             "| case | batch | ctx | layout | tile_b | heads | elements | warps | criticality us | its TB/s | t PSA us | "
             "t dense us | dense/PSA | fraction of bytes limit |", "|" + "---|" * 14]
    for r in rows:
        t = r["crit_tile"]
        head = f"| {r['case']} | {r['batch']} | {r['ctx']} | {r['meta_layout']} | {t['tile_b']} | {t['heads']} | " \
               f"{t['elements']} | {t['num_warps']} |"
        if "error" in r or "t_stage_us" not in r:
            lines.append(head + f" {r.get('error', 'no GPU timing')[:100]} |" + " |" * 5)
            continue
        f = r.get("fraction_of_bytes_limit")
        lines.append(head + f" {r['t_stage_us']['criticality']:.1f} | {r['criticality_tbps']:.2f} | "
                     f"{r['t_psa_us']:.1f} | {r['t_dense_us']:.1f} | {r['speedup']:.2f} | "
                     f"{'-' if f is None or not math.isfinite(f) else f'{f:.3f}'} |")
    (out / "psa_crit_sweep.md").write_text("\n".join(lines) + "\n")
    return rows


def _pick_fastest(rows: list, key, base_key: tuple, worse) -> tuple | None:
    """The key (of :func:`key` over the rows) with the fastest headline case (planted, batch 8, 128k) among keys that
    have a row for every swept case and are not ``worse(case, row, base_row)`` than ``base_key`` on any; failed rows
    never count."""
    ok = [r for r in rows if "error" not in r and math.isfinite(r.get("t_psa_us", float("nan")))]
    cases = sorted({(r["case"], r["batch"], r["ctx"]) for r in ok})
    by = {(r["case"], r["batch"], r["ctx"], key(r)): r for r in ok}
    best, best_t = None, None
    for k in sorted({key(r) for r in ok}):
        bad = False
        for c in cases:
            r, b = by.get((*c, k)), by.get((*c, base_key))
            if r is None or (b is not None and worse(c, r, b)):
                bad = True
        head = by.get(("planted", 8, 131072, k))
        if not bad and head is not None and (best_t is None or head["t_psa_us"] < best_t):
            best, best_t = k, head["t_psa_us"]
    return best


def _slower(case, r, b) -> bool:
    return r["t_psa_us"] > 1.03 * b["t_psa_us"]


def pick_crit(rows: list, base: tuple = CRIT_BASE) -> dict | None:
    """The (layout, launch shape) of a :func:`run_crit_sweep` report with the fastest headline layer (planted,
    batch 8, 128k), among those no slower than ``base`` by more than 3 % on any swept case (full layer time).
    ``{"meta_layout", "crit_tile": CritTile fields}`` or None."""
    t = base[1]
    best = _pick_fastest(rows, _crit_key, (base[0], t.tile_b, t.heads, t.elements, t.num_warps), _slower)
    if best is None:
        return None
    return dict(meta_layout=best[0], crit_tile=dict(tile_b=best[1], heads=best[2], elements=best[3], num_warps=best[4]))


def pick_wave_plan(rows: list, base: tuple = WAVE_BASE) -> dict | None:
    """The plan of a :func:`run_wave_sweep` report with the fastest headline case (planted, batch 8, 128k), among
    plans no slower than ``base`` (default: the defaults in force, :data:`WAVE_BASE`) by more than 3 % on any swept
    case and, on the testbed capture (real attention), reading no more blocks than the defaults (+0.5 % of all
    blocks). ``{"programs_per_sm", "wave_growth", "max_waves", "sorted_prefix_blocks"}`` or None."""

    def key(r):
        return (r["programs_per_sm"], float(r["wave_growth"]), r["max_waves"],
                r.get("sorted_prefix_blocks", WAVE_BASE[3]))

    def worse(case, r, b):
        return _slower(case, r, b) or (case[0] != "planted" and r["read_frac"] > b["read_frac"] + 0.005)

    best = _pick_fastest(rows, key, tuple(base), worse)
    return None if best is None else dict(programs_per_sm=best[0], wave_growth=best[1], max_waves=best[2],
                                          sorted_prefix_blocks=best[3])


def wave_plan_arg(value: str | None) -> tuple[dict | None, dict | None]:
    """``--wave-plan`` -> (:class:`PsaDecodeWrapper` keyword arguments, :class:`PsaDecodeConfig` overrides);
    ``(None, None)``: the defaults."""
    if not value:
        return None, None
    if value.startswith("best:"):
        plan = pick_wave_plan(json.loads(Path(value[5:]).read_text())["results"])
        print("plan picked from the sweep:", plan, flush=True)
        if plan is None:
            return None, None
        g = dict(wave_programs=plan["programs_per_sm"], wave_growth=plan["wave_growth"], max_waves=plan["max_waves"],
                 sorted_prefix_blocks=plan["sorted_prefix_blocks"])
    else:
        p, gr, w, *pf = value.split(",")
        g = dict(wave_programs=int(p), wave_growth=float(gr), max_waves=int(w),
                 sorted_prefix_blocks=int(pf[0]) if pf else WAVE_BASE[3])
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    return plan_kw(g, sms)
