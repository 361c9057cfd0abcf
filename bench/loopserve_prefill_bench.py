"""LoopServe sparse prefill (estimation + selection + attention) vs FlashInfer dense causal prefill, one GPU.

Per context (Llama-3.1-8B attention shapes: 32 qo / 8 kv heads, head_dim 128, bf16; one request,
one layer, the whole prompt as one extend segment, keys in SGLang's pool layout
``[slots, kv_heads, head_dim]`` with shuffled slots):

* sparse = the server's per-layer work for a sparse extend row (``sglang_sparse.loopserve.runner``):
  :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate` over ``sampled_rows`` rows chosen by
  :func:`~flashinfer_ext.loopserve.vs_estimate.sample_query_rows`, :func:`flashinfer_ext.loopserve.vs_select.vs_select`
  (alpha), :func:`flashinfer_ext.loopserve.vs_prefill.vs_prefill` over the selected lines: all timed together;
* dense = ``flashinfer.prefill.single_prefill_with_kv_cache(causal=True)`` on contiguous K/V;
* served = what the server runs at that context: dense below ``min_context`` (the config default
  unless ``--min-context``), else sparse. ``speedup_*`` in the JSON are dense / served.

Also: achieved TFLOP/s of the dense baseline (causal FLOPs ``4 * T^2/2 * qo_heads * head_dim``)
against a measured bf16 matmul peak (8192^3 ``torch.matmul``), the fraction of lines selected, the
covered-mass bound, and the output error of the sparse path against dense.

Workloads: (a) planted structure (:func:`plant`: a rope-like local band + strong vertical columns +
per-KV-head slash offsets, small noise), (b) the same with weaker columns (``planted-diffuse``, 32k and 128k), (c) SmolLM2-135M q/k/v captured on
real text (``--smollm``; its own shapes 9/3 heads, d=64; needs transformers + the model), (d) ``testbed
real``: q/k/v of layers 3/15/27 of the 32k testbed model (SmolLM2-135M + YaRN) captured on its own
~32k needle prompt (:mod:`bench.real_capture`), plus the true covered mass of the selected lines on
256 uniform query rows; summary key ``real_32k`` = {line_fraction, speedup_vs_dense, covered_mass,
...} (run when ``--testbed-model`` exists; ``--real-only`` runs it alone and merges it into the
``loopserve_prefill.json`` already in ``--out``).

CUDA events, warmup, median of ``iters`` (fewer at 64k/128k). Writes ``loopserve_prefill.md``,
``loopserve_prefill.json`` (``gpu``, ``speedup_128k``, ``speedup_32k``, ``speedup_4k`` computed from
the rows, + every row) and ``loopserve_prefill.png`` (matplotlib if importable) into ``--out``.
``--smoke`` runs tiny shapes on the CPU (Triton interpreter, torch reference for dense; timings
meaningless) to check the script end to end.

    python bench/loopserve_prefill_bench.py --out bench/results          # ~3 min on an H100
    python bench/loopserve_prefill_bench.py --out /tmp/b --smoke         # CPU, ~1 min
    python bench/loopserve_prefill_bench.py --out bench/results --real-only \
        --testbed-model /tmp/models/SmolLM2-135M-Instruct-32k
    python bench/loopserve_prefill_bench.py --out /tmp/b --real-only --real-tokens 1024 --real-layers 3,15   # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels run under the Triton interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import real_capture  # noqa: E402
from bench.line_work import line_work  # noqa: E402
from bench.timing import timed  # noqa: E402
from flashinfer_ext.loopserve.vs_estimate import sample_query_rows, vs_estimate  # noqa: E402
from flashinfer_ext.loopserve.vs_prefill import launch_shape, vs_prefill  # noqa: E402
from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select, vs_select_plan  # noqa: E402
from sglang_sparse.config import LoopServeConfig  # noqa: E402  (plain dataclasses, no sglang import)

ALPHA = VSSelectConfig.alpha  # the paper's alpha (the kernel default; the server's default is LoopServeConfig.alpha)
SERVED_ALPHA = LoopServeConfig.alpha  # the testbed real rows: what a server at defaults selects
SAMPLED_ROWS = 64
SINK, LOCAL = VSSelectConfig.sink_tokens, VSSelectConfig.local_window
# planted structure (see plant()): logit scales in nats
PLANT = dict(band_peak=4.0, slashes=2, slash_peak=6.0, verticals=48, vertical_logit=12.0)
# weaker columns: ~10 % of the mass is the band/slashes' diffuse far field, which alpha-coverage must
# then buy with many lines (CPU check at 32k: ~4.5k slash lines per head, line fraction ~0.07)
DIFFUSE = dict(PLANT, vertical_logit=9.0, band_peak=6.0, slash_peak=8.0)
CONTEXTS = (131072, 32768, 4096, 8192, 16384, 65536)  # headline contexts first: a timeout keeps them


def default_min_context() -> int:
    from sglang_sparse.config import LoopServeConfig  # no sglang import in that module

    return LoopServeConfig().min_context




def matmul_peak_tflops(dev) -> float:
    if dev != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    t = timed(lambda: a @ b, iters=10, warmup=3)
    return 2 * n ** 3 / t / 1e12


def _rot_heads(a, pos, off, w):
    """``[T, Hk, 2P]``: pair ``i`` of ``a[h]`` rotated by ``w[i] * (pos + off[h])`` (a rope-like map)."""
    ang = (pos[:, None] + off[None, :]).float()[..., None] * w[None, None, :]   # [T, Hk, P]
    c, s = ang.cos(), ang.sin()
    x0, x1 = a[None, :, 0::2], a[None, :, 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)


def plant(t, hq, hk, d, dev, seed=0, p=PLANT):
    """q/k/v ``[T, H, d]`` bf16 whose causal attention logits (nats, after ``d**-0.5``) are, per KV head,

    * a local band: ``band_peak / P * sum_i cos(w_i (t - j))`` over ``P = d // 8`` log-spaced
      frequencies ``1 .. 1/64`` (peak at offset 0, decaying over tens of tokens; its far field is a
      bounded quasi-random term of std ~ ``band_peak / sqrt(2P)``);
    * ``slashes`` far diagonals: the same with ``1.5 P`` random high frequencies, peaking where
      ``t - j`` is one of that head's offsets (drawn in ``[LOCAL, T/2)``);
    * ``verticals`` columns (+ the ``SINK`` first keys) at ``+vertical_logit`` for every query.
    All query heads of a group share the structure. V is Gaussian.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    pb, ps = d // 8, (d // 8) * 3 // 2
    assert 2 * (pb + ps) + 1 <= d
    pos = torch.arange(t, device=dev)
    zero = torch.zeros(hk, dtype=torch.long, device=dev)
    w_band = torch.logspace(0, -1.8, pb).to(dev)
    a_band = torch.full((hk, 2 * pb), math.sqrt(p["band_peak"] / (2 * pb)), device=dev)
    w_sl = (torch.rand(ps, generator=g) * 2.5 + 0.5).to(dev)
    a_sl = torch.full((hk, 2 * ps), math.sqrt(p["slash_peak"] / (2 * ps)), device=dev)
    offs = torch.randint(LOCAL, max(LOCAL + 1, t // 2), (hk, p["slashes"]), generator=g).to(dev)
    q = torch.zeros(t, hk, d, device=dev)
    k = torch.zeros(t, hk, d, device=dev)
    q[:, :, :2 * pb] = _rot_heads(a_band, pos, zero, w_band)
    k[:, :, :2 * pb] = _rot_heads(a_band, pos, zero, w_band)
    q[:, :, 2 * pb:2 * (pb + ps)] = _rot_heads(a_sl, pos, zero, w_sl)
    for m in range(p["slashes"]):  # key j peaks for queries t = j + offs[h, m]
        k[:, :, 2 * pb:2 * (pb + ps)] += _rot_heads(a_sl, pos, offs[:, m], w_sl)
    vert = torch.zeros(t, hk, device=dev)
    for h in range(hk):
        vert[torch.randperm(t, generator=g)[: p["verticals"]].to(dev), h] = 1.0
    vert[:SINK] = 1.0
    q[:, :, -1] = math.sqrt(p["vertical_logit"])
    k[:, :, -1] = vert * math.sqrt(p["vertical_logit"])
    root = (d ** -0.5) ** 0.5  # q.k * d**-0.5 = the logits above
    q = (q / root).repeat_interleave(hq // hk, dim=1)
    k = k / root
    v = torch.randn(t, hk, d, generator=g).to(dev)
    return q.bfloat16().contiguous(), k.bfloat16().contiguous(), v.bfloat16().contiguous()


def pool_of(k, v, dev, seed=1):
    """Scatter contiguous K/V ``[T, Hk, d]`` into a pool with shuffled slots; returns (k_buf, v_buf, slots)."""
    t = k.shape[0]
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = (torch.randperm(t + 64, generator=g)[:t] + 1).to(dev)
    k_buf = torch.zeros(t + 65, *k.shape[1:], dtype=k.dtype, device=dev)
    v_buf = torch.zeros_like(k_buf)
    k_buf[slots] = k
    v_buf[slots] = v
    return k_buf, v_buf, slots.to(torch.int32)


def phase_times(q, k_buf, v_buf, slots, sm_scale, iters, alpha=ALPHA, out=None) -> dict:
    """Where :func:`sparse_prefill`'s time goes: each phase timed alone on the same inputs (median CUDA-event ms),
    and the host time to issue the selection (median ms, no sync: above its event time it is launch-bound). The
    selection is timed as a server layer runs it: with the segment's plan (:func:`vs_select_plan`, built once per
    segment for all its layers) already built."""
    t = q.shape[0]
    sample = sample_query_rows(t, SAMPLED_ROWS).to(q.device)
    q_s = q[sample].contiguous()
    plan = vs_select_plan(t, 0, VSSelectConfig(alpha=alpha, sink_tokens=SINK, local_window=LOCAL), q.device)
    lines = vs_estimate(q_s, sample, k_buf, slots, t, sm_scale=sm_scale)
    sel = vs_select(lines, plan=plan)
    hosts = []
    for _ in range(iters):
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        vs_select(lines, plan=plan)
        hosts.append((time.perf_counter() - t0) * 1e3)
    hosts.sort()
    top = {}
    if q.is_cuda:  # the selection's kernels by GPU time (one call): where its time goes
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            vs_select(lines, plan=plan)
            torch.cuda.synchronize()
        ev = sorted(prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True)[:6]
        top = {e.key[:60]: round(getattr(e, "self_device_time_total", 0.0), 1) for e in ev}
    return dict(select_top_gpu_us=top,
        t_estimate_ms=timed(lambda: vs_estimate(q_s, sample, k_buf, slots, t, sm_scale=sm_scale), iters=iters) * 1e3,
        t_select_ms=timed(lambda: vs_select(lines, plan=plan), iters=iters) * 1e3,
        t_select_host_ms=hosts[len(hosts) // 2],
        t_attention_ms=timed(lambda: vs_prefill(q, k_buf, v_buf, slots, prefix_len=0, seq_len=t, v_idx=sel.v_idx,
                                                v_cnt=sel.v_cnt, s_idx=sel.s_idx, s_cnt=sel.s_cnt, sm_scale=sm_scale,
                                                out=out), iters=iters) * 1e3)


def select_lines(q, k_buf, slots, sm_scale, alpha=ALPHA):
    """A server layer's line selection for one first segment (prefix 0): estimate on the sampled rows, then select."""
    t = q.shape[0]
    sample = sample_query_rows(t, SAMPLED_ROWS).to(q.device)
    lines = vs_estimate(q[sample].contiguous(), sample, k_buf, slots, t, sm_scale=sm_scale)
    return vs_select(lines, prefix_len=0, config=VSSelectConfig(alpha=alpha, sink_tokens=SINK, local_window=LOCAL))


def sparse_prefill(q, k_buf, v_buf, slots, sm_scale, alpha=ALPHA, out=None):
    """The server's per-layer sparse extend of one first segment (prefix 0); returns (o, selection)."""
    t = q.shape[0]
    sel = select_lines(q, k_buf, slots, sm_scale, alpha=alpha)
    o, _ = vs_prefill(q, k_buf, v_buf, slots, prefix_len=0, seq_len=t, v_idx=sel.v_idx, v_cnt=sel.v_cnt,
                      s_idx=sel.s_idx, s_cnt=sel.s_cnt, sm_scale=sm_scale, out=out)
    return o, sel


DENSE_IMPL = ["flashinfer"]  # main() falls back to "torch sdpa" (and says so in the report) without FlashInfer


def dense_fn(q, k, v, sm_scale):
    """FlashInfer dense causal prefill (torch reference on CPU)."""
    if q.is_cuda and DENSE_IMPL[0] == "flashinfer":
        import flashinfer

        return lambda: flashinfer.prefill.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=sm_scale)

    def ref():  # fp32 on the CPU (smoke); the tensors' own dtype on CUDA (FlashAttention-backed SDPA)
        g = q.shape[1] // k.shape[1]
        dt = q.dtype if q.is_cuda else torch.float32
        kk = k.to(dt).repeat_interleave(g, 1).transpose(0, 1)
        vv = v.to(dt).repeat_interleave(g, 1).transpose(0, 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.to(dt).transpose(0, 1), kk, vv, is_causal=True, scale=sm_scale).transpose(0, 1).to(q.dtype)
    return ref


def run_case(name, ctx, q, k, v, min_context, dev, iters, timing=True, return_sel=False, alpha=ALPHA):
    """One sparse vs dense prefill measurement on ``q [T, Hq, d]``, ``k``/``v`` ``[T, Hk, d]`` (bf16).
    ``timing=False`` runs each side once and leaves the times NaN (CPU runs of captured cases);
    ``return_sel`` also returns the :class:`~flashinfer_ext.loopserve.vs_select.VSSelection`."""
    t, hq, d = q.shape
    hk = k.shape[1]
    sm_scale = d ** -0.5
    k_buf, v_buf, slots = pool_of(k, v, dev)
    out = torch.empty_like(q)
    dense = dense_fn(q, k, v, sm_scale)
    o_sp, sel = sparse_prefill(q, k_buf, v_buf, slots, sm_scale, alpha=alpha, out=out)
    o_dn = dense()
    err = (o_sp.float() - o_dn.float()).abs()
    nan = float("nan")
    t_sparse = timed(lambda: sparse_prefill(q, k_buf, v_buf, slots, sm_scale, alpha=alpha, out=out), iters=iters,
                     warmup=2) \
        if timing else nan
    t_dense = timed(dense, iters=iters, warmup=2) if timing else nan
    served_sparse = ctx >= min_context
    t_served = t_sparse if served_sparse or not timing else timed(dense, iters=iters, warmup=2)  # 2nd timing of it
    flops = 4.0 * t * (t + 1) / 2 * hq * d
    n_lines = float((sel.v_cnt.sum() + sel.s_cnt.sum()).item())
    phases = phase_times(q, k_buf, v_buf, slots, sm_scale, iters, alpha=alpha, out=out) if timing else {}
    res = dict(case=name, alpha=alpha, ctx=t, heads=f"{hq}/{hk}", head_dim=d, t_sparse_ms=t_sparse * 1e3, **phases,
                t_dense_ms=t_dense * 1e3, t_served_ms=t_served * 1e3, served="sparse" if served_sparse else "dense",
                sparse_speedup=t_dense / t_sparse, served_speedup=t_dense / t_served,
                dense_tflops=flops / t_dense / 1e12, line_fraction=n_lines / (2.0 * t * hk),
                vertical_lines_per_head=float(sel.v_cnt.float().mean().item()),
                slash_lines_per_head=float(sel.s_cnt.float().mean().item()),
                covered_lb_mean=float(sel.covered_lb.mean().item()),
                out_err_mean=float(err.mean().item()), out_err_max=float(err.max().item()))
    g_pad = 1 << max(0, (hq // hk - 1).bit_length())  # vs_prefill's default launch: block_m 64 rows, launch_shape's keys
    res.update({f"work_{k}": v for k, v in line_work(sel.v_idx, sel.v_cnt, sel.s_idx, sel.s_cnt, t,
                                                     block_q=max(1, 64 // g_pad), block_n=launch_shape(d)[0]).items()})
    return (res, sel) if return_sel else res


def capture_smollm(num_tokens, layer, dev):
    sys.path.insert(0, str(ROOT / "bench"))
    from psa_capture import capture_qkv  # noqa: E402

    q, k, v = capture_qkv(num_tokens=num_tokens, layers=(layer,), device=dev)[layer]
    return q.bfloat16().to(dev).contiguous(), k.bfloat16().to(dev).contiguous(), v.bfloat16().to(dev).contiguous()


REAL_SLOTS = {"real_32k": 32000}  # prompt tokens of the testbed capture
REAL_LAYERS = (3, 15, 27)
EVAL_ROWS = 256  # query rows (uniform over the prompt) whose true covered mass is measured


def run_real(model_dir, slot_tokens: dict, layers, dev: str, min_context: int, iters: int = 10,
             eval_rows: int = EVAL_ROWS) -> list:
    """The ``testbed real`` rows: one capture of the 32k testbed model on its ~32k needle prompt
    (:mod:`bench.real_capture`; 9/3 heads, d=64, bf16), then per layer of ``layers`` the whole prompt
    as one extend segment through :func:`run_case` (timed on CUDA only), plus the true covered mass of
    the selected lines (:func:`bench.real_capture.covered_mass`) on ``eval_rows`` query rows drawn
    uniformly (seeded) over the prompt, and on its last 64 rows (the question; partly rows the estimate
    sampled)."""
    rows = []
    try:
        for slot, cap, info in real_capture.testbed_captures(model_dir, slot_tokens, tuple(layers), dev):
            for layer in layers:
                name = real_capture.REAL_CASE
                try:
                    q, k, v = (x.bfloat16().to(dev).contiguous() for x in cap[layer])
                    T = q.shape[0]
                    r, sel = run_case(name, T, q, k, v, min_context, dev, iters, timing=dev == "cuda",
                                      return_sel=True, alpha=SERVED_ALPHA)
                    g = torch.Generator().manual_seed(layer)
                    uni = torch.randperm(T, generator=g)[:eval_rows].sort().values
                    tail = torch.arange(max(0, T - 64), T)
                    cm = real_capture.covered_mass(q, k, sel, uni, q.shape[-1] ** -0.5)
                    cm_tail = real_capture.covered_mass(q, k, sel, tail, q.shape[-1] ** -0.5)
                    r.update(slot=slot, layer=layer, covered_mass=float(cm.mean()),
                             covered_mass_per_kv_head=[round(float(x), 4) for x in cm],
                             covered_mass_tail64=float(cm_tail.mean()), covered_eval_rows=int(uni.numel()), **info)
                    print(json.dumps(r), flush=True)
                except Exception as e:
                    traceback.print_exc()
                    r = dict(case=name, slot=slot, layer=layer, ctx=info["prompt_len"], **info,
                             error=f"{type(e).__name__}: {e}")
                rows.append(r)
                q = k = v = None
                if dev == "cuda":
                    torch.cuda.empty_cache()
    except Exception as e:  # model load / capture failed
        traceback.print_exc()
        done = {r["slot"] for r in rows}
        rows += [dict(case=real_capture.REAL_CASE, slot=s, model=str(model_dir), error=f"{type(e).__name__}: {e}")
                 for s in slot_tokens if s not in done]
    return rows


def real_summary(results, gpu) -> dict:
    """``{"real_32k": {...}}`` from the ``testbed real`` rows, over the captured layers: mean line fraction
    (selected vertical + slash lines / (2 T Hk)), FlashInfer dense time / sparse time (sums over the layers;
    null without a GPU timing), mean true covered mass on uniform rows; per layer beside them."""
    out = {}
    f = real_capture.finite
    for slot in REAL_SLOTS:
        rs = [r for r in results if r.get("case") == real_capture.REAL_CASE and r.get("slot") == slot]
        if not rs:
            continue
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[slot] = dict(line_fraction=None, speedup_vs_dense=None, covered_mass=None, error=rs[0]["error"],
                             gpu=gpu)
            continue
        mean = lambda key: f(sum(r[key] for r in ok) / len(ok))  # noqa: E731
        out[slot] = dict(line_fraction=mean("line_fraction"),
                         speedup_vs_dense=f(sum(r["t_dense_ms"] for r in ok) / sum(r["t_sparse_ms"] for r in ok)),
                         covered_mass=mean("covered_mass"), covered_mass_tail64=mean("covered_mass_tail64"),
                         covered_lb=mean("covered_lb_mean"), ctx=ok[0]["ctx"], layers=[r["layer"] for r in ok],
                         area_fraction=mean("work_area_fraction"), tile_fraction=mean("work_tile_fraction"),
                         slash_blocks_crossed=mean("work_slash_blocks_crossed"),
                         failed_layers=[r["layer"] for r in rs if "error" in r],
                         per_layer=[dict(layer=r["layer"], line_fraction=f(r["line_fraction"]),
                                         speedup_vs_dense=f(r["sparse_speedup"]), covered_mass=f(r["covered_mass"]))
                                    for r in ok], alpha=SERVED_ALPHA, gpu=gpu)
    return out


def summary(meta, results):
    def served(ctx):
        r = next((r for r in results if r.get("case") == "planted" and r.get("ctx") == ctx and "error" not in r), None)
        return None if r is None or not math.isfinite(r["served_speedup"]) else float(r["served_speedup"])

    def raw(ctx):
        r = next((r for r in results if r.get("case") == "planted" and r.get("ctx") == ctx and "error" not in r), None)
        return None if r is None else float(r["sparse_speedup"])

    big = max((r["ctx"] for r in results if r.get("case") == "planted" and "error" not in r), default=None)
    return {"gpu": meta["gpu"], "speedup_128k": served(131072), "speedup_32k": served(32768),
            "speedup_4k": served(4096), "sparse_kernel_speedup_4k": raw(4096),
            "sparse_kernel_speedup_8k": raw(8192), "min_context": meta["min_context"],
            "largest_ctx": big, "matmul_peak_tflops": meta["peak_tflops"],
            "dense_tflops_128k": next((r["dense_tflops"] for r in results if r.get("case") == "planted"
                                       and r.get("ctx") == 131072 and "error" not in r), None),
            "smollm2_sparse_speedup": next((r["sparse_speedup"] for r in results
                                            if r.get("case", "").startswith("smollm2") and "error" not in r), None),
            **real_summary(results, meta["gpu"])}


def write_report(out: Path, meta, results, top=None):
    """Write ``loopserve_prefill.{json,md,png}``; ``top`` (a merged ``--real-only`` run) replaces the summary."""
    out.mkdir(parents=True, exist_ok=True)
    top = summary(meta, results) if top is None else top
    (out / "loopserve_prefill.json").write_text(json.dumps(dict(**top, meta=meta, results=results), indent=1))
    lines = ["# LoopServe sparse prefill vs FlashInfer dense causal prefill", "",
             f"- command: `{meta['command']}`", f"- device: {meta['gpu']}; bf16 matmul peak "
             f"{meta['peak_tflops']:.0f} TFLOP/s (8192^3 torch.matmul)", f"- versions: {meta['versions']}",
             f"- shapes: {meta['shapes']}; dense implementation: {meta.get('dense_impl')}", f"- sparse = vs_estimate ({SAMPLED_ROWS} sampled rows) + vs_select "
             f"(alpha {ALPHA}, sink {SINK}, local window {LOCAL}) + vs_prefill, timed together; dense = "
             "flashinfer single_prefill_with_kv_cache(causal=True); served = dense below min_context "
             f"({meta['min_context']}), else sparse; median of CUDA-event timings",
             f"- planted structure: {meta['plant']}; planted-diffuse: {meta.get('plant_diffuse')} (see plant())", "",
             "## Summary", "", "```", json.dumps(top, indent=1), "```", "",
             "| case | ctx | heads | t sparse ms | t dense ms | served | t served ms | dense/sparse | dense/served |"
             " dense TFLOP/s (of peak) | line frac | verticals/head | slashes/head | covered lb | err mean | err max |",
             "|" + "---|" * 16]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r.get('ctx')} | FAILED: {r['error'][:160]} |" + " |" * 13)
            continue
        lines.append(f"| {r['case']} | {r['ctx']} | {r['heads']} | {r['t_sparse_ms']:.3f} | {r['t_dense_ms']:.3f} | "
                     f"{r['served']} | {r['t_served_ms']:.3f} | {r['sparse_speedup']:.2f} | {r['served_speedup']:.2f} | "
                     f"{r['dense_tflops']:.0f} ({r.get('dense_frac_of_matmul_peak', float('nan')):.2f}) | {r['line_fraction']:.4f} | {r['vertical_lines_per_head']:.0f} | "
                     f"{r['slash_lines_per_head']:.0f} | {r['covered_lb_mean']:.3f} | {r['out_err_mean']:.2e} | "
                     f"{r['out_err_max']:.2e} |")
    lines += ["", "Sparse path by phase (each timed alone, median ms; select = one layer's selection with its segment's plan built, as a server layer runs it; select host = the host time to issue it):", "",
              "| case | ctx | estimate | select | select host | attention | sum of phases | sparse (together) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" not in r and "t_estimate_ms" in r:
            tot = r["t_estimate_ms"] + r["t_select_ms"] + r["t_attention_ms"]
            lines.append(f"| {r['case']} | {r['ctx']} | {r['t_estimate_ms']:.3f} | {r['t_select_ms']:.3f} | "
                         f"{r['t_select_host_ms']:.3f} | {r['t_attention_ms']:.3f} | {tot:.3f} | {r['t_sparse_ms']:.3f} |")
    real = [r for r in results if r.get("case") == real_capture.REAL_CASE and "error" not in r]
    if real:
        rm = meta.get("real_run") or meta
        lines += ["", f"Testbed real attention (bench/real_capture.py: the 32k testbed model on its needle prompt, "
                      f"q/k/v of layers {rm.get('real_layers')}; `{rm.get('command')}` on {rm.get('gpu')}). Covered "
                      "mass = true causal attention mass on the selected lines, over uniform query rows / the last 64 "
                      "rows; covered lb = the selection's own bound on its sampled rows; area = causal entries the lines keep "
                      "(bench/line_work.py: an entry-exact kernel's share of dense FLOPs); tiles = the tiles vs_prefill "
                      "computes over the causal tiles of its shape (gathered verticals + key blocks a slash crosses), "
                      "slash tiles = the second part alone:", "",
                  "| layer | ctx | line frac | covered mass | covered (last 64) | covered lb | area | tiles | slash tiles "
                  "| dense/sparse |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in real:
            lines.append(f"| {r['layer']} | {r['ctx']} | {r['line_fraction']:.4f} | {r['covered_mass']:.4f} | "
                         f"{r['covered_mass_tail64']:.4f} | {r['covered_lb_mean']:.4f} | "
                         f"{r.get('work_area_fraction', float('nan')):.3f} | {r.get('work_tile_fraction', float('nan')):.3f} | "
                         f"{r.get('work_slash_blocks_crossed', float('nan')):.3f} | {r['sparse_speedup']:.2f} |")
    for r in results:
        if r.get("select_top_gpu_us"):
            lines += ["", f"vs_select kernels by GPU time, {r['case']} {r['ctx']} (us, one call): " +
                      "; ".join(f"`{k}` {v}" for k, v in r["select_top_gpu_us"].items())]
    (out / "loopserve_prefill.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        with open(out / "loopserve_prefill.md", "a") as fh:
            fh.write("\n(no PNG: matplotlib is not importable here)\n")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for case in sorted({r["case"] for r in results if "error" not in r and r["case"] != real_capture.REAL_CASE}):
        pts = sorted((r["ctx"], r["sparse_speedup"]) for r in results if r["case"] == case and "error" not in r)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{case}: dense / sparse")
    pts = sorted((r["ctx"], r["served_speedup"]) for r in results if r["case"] == "planted" and "error" not in r)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x", ls="--", label="planted: dense / served")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speedup over FlashInfer dense prefill")
    ax.set_title(f"LoopServe prefill (alpha {ALPHA}), {meta['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loopserve_prefill.png", dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--min-context", type=int, default=None,
                    help="the server's min_context (default: LoopServeConfig's default)")
    ap.add_argument("--max-ctx", type=int, default=131072)
    ap.add_argument("--smollm", action="store_true", help="also SmolLM2-135M captures (8k tokens, layer 15)")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated planted contexts to run instead of the default cases (e.g. the break-even "
                         "of min_context: 8192,16384,24576); every one runs (no --time-budget)")
    ap.add_argument("--time-budget", type=float, default=1e9,
                    help="seconds after the first case: extra cases not started by then are recorded as skipped "
                         "(the 128k/32k/4k planted cases and --smollm always run)")
    ap.add_argument("--real-only", action="store_true",
                    help="only the testbed real case (real_32k), merged into an existing loopserve_prefill.json in "
                         "--out (its rows and summary keys kept; the real ones replaced); runs on a CPU too")
    ap.add_argument("--no-real", action="store_true", help="skip the testbed real case in a full run")
    ap.add_argument("--testbed-model", type=Path, default=real_capture.TESTBED_MODEL,
                    help="the 32k testbed model folder (default: the repo's models/SmolLM2-135M-Instruct-32k)")
    ap.add_argument("--real-tokens", default=None, help="prompt tokens of real_32k (default 32000; e.g. 1024 on a CPU)")
    ap.add_argument("--real-layers", default=",".join(map(str, REAL_LAYERS)), help="captured layers")
    ap.add_argument("--real-eval-rows", type=int, default=EVAL_ROWS,
                    help="uniform query rows of the true covered mass")
    args = ap.parse_args()
    slot_tokens = real_capture.parse_tokens(args.real_tokens, REAL_SLOTS)
    real_layers = tuple(int(x) for x in args.real_layers.split(","))
    t0 = time.time()
    import triton

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
        DENSE_IMPL[0] = "torch sdpa (flashinfer not importable)"
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    min_context = args.min_context if args.min_context is not None else default_min_context()
    meta = dict(command=" ".join([sys.executable.split("/")[-1]] + sys.argv),
                gpu=torch.cuda.get_device_name() if dev == "cuda" else
                f"CPU ({platform.processor() or 'cpu'}, Triton interpreter: timings meaningless)",
                versions=f"torch {torch.__version__}, triton {triton.__version__}, flashinfer "
                         f"{getattr(flashinfer, '__version__', None)}, python {platform.python_version()}",
                shapes="Llama-3.1-8B attention: 32 qo / 8 kv heads, head_dim 128, bf16, one request, one layer",
                plant=PLANT, plant_diffuse=DIFFUSE, min_context=min_context, alpha=ALPHA,
                dense_impl=DENSE_IMPL[0] if dev == "cuda" else "torch sdpa (CPU smoke)")
    meta.update(real_tokens=slot_tokens, real_layers=list(real_layers), testbed_model=str(args.testbed_model))
    meta["peak_tflops"] = matmul_peak_tflops(dev)
    if args.real_only:
        rows = run_real(args.testbed_model, slot_tokens, real_layers, dev, min_context, eval_rows=args.real_eval_rows)
        real_capture.finish_real_only(args.out / "loopserve_prefill.json", rows, real_summary(rows, meta["gpu"]), meta, write_report, t0)
        return
    if args.smoke:
        cases = [("planted", c, dict(hq=4, hk=2, d=64)) for c in (96, 160)]
        meta["min_context"] = min_context = 128
    else:
        llama = dict(hq=32, hk=8, d=128)
        cases = [("planted", c, llama) for c in CONTEXTS[:3] if c <= args.max_ctx]
        cases += [("smollm2", 8192, None)] if args.smollm else []
        cases += [("planted-diffuse", c, dict(llama, plant=DIFFUSE)) for c in (32768, 131072) if c <= args.max_ctx]
        cases += [("planted", c, llama) for c in CONTEXTS[3:] if c <= args.max_ctx]
    required = {("planted", c) for c in CONTEXTS[:3]} | {("smollm2", 8192)}
    if args.contexts and not args.smoke:
        cases = [("planted", int(c), llama) for c in args.contexts.split(",")]
        required = {(n, c) for n, c, _ in cases}
    results = []
    # the headline contexts and the SmolLM2 capture always run; --time-budget only drops the extra cases,
    # and its clock starts after the first case (on a cold machine the JIT compiles of FlashInfer and of
    # the Triton kernels can take longer than the whole budget)
    t_budget0 = None
    for name, ctx, sh in cases:
        if (name, ctx) not in required and t_budget0 is not None and time.time() - t_budget0 > args.time_budget:
            results.append(dict(case=name, ctx=ctx, error=f"skipped: --time-budget {args.time_budget:.0f} s spent"))
            continue
        if t_budget0 is None and results:
            t_budget0 = time.time()
        if name == "smollm2":
            try:
                q, k, v = capture_smollm(ctx, 15, dev)
                r = run_case("smollm2 real text (layer 15)", q.shape[0], q, k, v, min_context, dev, 10)
                print(json.dumps(r), flush=True)
                results.append(r)
            except Exception as e:
                traceback.print_exc()
                results.append(dict(case="smollm2 real text (layer 15)", ctx=ctx, error=f"{type(e).__name__}: {e}"))
            continue
        try:
            q, k, v = plant(ctx, sh["hq"], sh["hk"], sh["d"], dev, p=sh.get("plant", PLANT))
            iters = 3 if ctx >= 65536 else 10
            r = run_case(name, ctx, q, k, v, min_context, dev, iters)
            r["dense_frac_of_matmul_peak"] = r["dense_tflops"] / meta["peak_tflops"]
            print(json.dumps(r), flush=True)
            results.append(r)
        except Exception as e:
            traceback.print_exc()
            results.append(dict(case=name, ctx=ctx, error=f"{type(e).__name__}: {e}"))
        finally:
            q = k = v = None
            if dev == "cuda":
                torch.cuda.empty_cache()
        write_report(args.out, meta, results)
    if not (args.no_real or args.smoke or args.contexts):
        if (args.testbed_model / "config.json").is_file():
            results += run_real(args.testbed_model, slot_tokens, real_layers, dev, min_context,
                                eval_rows=args.real_eval_rows)
        else:  # a device without the testbed folder: no error rows that would hide an earlier --real-only run
            meta["real_skipped"] = f"no testbed model at {args.testbed_model} (--testbed-model)"
            print(meta["real_skipped"])
    meta["wall_s"] = time.time() - t0
    write_report(args.out, meta, results)
    print(json.dumps(summary(meta, results)))
    print(f"wrote {args.out}/loopserve_prefill.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
