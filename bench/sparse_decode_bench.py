"""Sparse decode kernels on per-(request, KV head) token lists: one program per pair vs split-list, vs dense FlashInfer.

LoopServe's and lastwindow's decode attend a different token list per (request, KV head)
(:func:`flashinfer_ext.common.sparse_decode.decode_union_lists`, ``block_size=1``). This measures, on the same lists:

* ``one_program``: :func:`flashinfer_ext.common.sparse_decode.sparse_decode` (``epsilon=1``; grid = pairs),
* ``split``: :func:`flashinfer_ext.common.split_decode.sparse_decode_split` (spans on separate programs + a merge;
  split count from :func:`~flashinfer_ext.common.split_decode.plan_splits` with 2 x the SM count as target),
* ``dense``: FlashInfer's paged decode over the whole context (page 16; the stock decode a layer replaces),

each replayed from a CUDA graph (kernel time, no launch overhead), median of CUDA-event timings. Reported per
case: microseconds, ``split`` speed-up over ``one_program``, ``split`` time / ``dense`` time, and achieved
bandwidth of ``split`` (bytes of the listed K and V rows it reads) against the measured peak (a 1 GiB
device-to-device copy). Shapes: SmolLM2-135M (9 / 3 heads, d 64) and Llama-3.1-8B (32 / 8, d 128), bf16, random
keys (the lists are random distinct positions: the kernels' cost does not depend on the scores).

    python bench/sparse_decode_bench.py --out DIR          # GPU: DIR/sparse_decode.{json,md}
    python bench/sparse_decode_bench.py --out DIR --smoke  # CPU (Triton interpreter): one tiny case
    python bench/sparse_decode_bench.py --out DIR --sweep  # GPU: DIR/split_sweep.{json,md}, the split kernel's
                                                           # tile / warps / stages on testbed shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels run under the Triton interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")
if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.psa_decode_bench import build_pool, graph_of, measure_peak_bw  # noqa: E402
from bench.timing import timed  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
# (shape, batch, context, list width): loopserve budget 1024 + lines + tail ~1.1k; lastwindow 128 + window ~200
CASES = [("smollm2", 1, 2700, 1100), ("smollm2", 1, 2700, 200), ("smollm2", 8, 8192, 1100),
         ("llama8b", 1, 32768, 2048), ("llama8b", 8, 32768, 2048), ("llama8b", 32, 32768, 1100),
         ("llama8b", 8, 131072, 4096)]
SMOKE = [("smoke", 2, 300, 140)]
# --sweep: the 32k testbed's decode (SmolLM2 at 32k, lists of ~5.5k / ~10k / ~12.8k tokens per KV head); "graph"
# plans the spans as LoopServe's captured decode graph of that batch size does (for a graph_list_width of 32768),
# "invariant" as under deterministic inference (the one-row plan at every batch size), "eager" for the batch's lists
SWEEP_CASES = [("smollm2", 1, 32768, 5500, "graph"), ("smollm2", 8, 32768, 5500, "graph"),
               ("smollm2", 32, 32768, 5500, "graph"), ("smollm2", 1, 32768, 10000, "graph"),
               ("smollm2", 8, 32768, 10000, "graph"), ("smollm2", 32, 32768, 10000, "graph"),
               ("smollm2", 8, 32768, 12800, "graph"), ("smollm2", 32, 32768, 10000, "invariant"),
               ("smollm2", 8, 32768, 5500, "eager")]
SWEEP_TILES, SWEEP_WARPS, SWEEP_STAGES = (32, 64, 128), (2, 4, 8), (1, 2, 3)


def random_lists(batch, hk, ctx, width, dev, seed=0):
    """``[batch, hk, width]`` int32 distinct random positions ``< ctx`` per pair (full lists)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    keys = torch.rand(batch * hk, ctx, device=dev, generator=g)
    lists = keys.topk(width, dim=1).indices.to(torch.int32).view(batch, hk, width).contiguous()
    return lists, torch.full((batch, hk), width, dtype=torch.int32, device=dev)


def run_case(shape, batch, ctx, width, dev, peak_bps, sm_count):
    from flashinfer_ext.common.sparse_decode import sparse_decode
    from flashinfer_ext.common.split_decode import alloc_split_buffers, plan_splits, sparse_decode_split

    hq, hk, d = SHAPES.get(shape, (4, 2, 64))
    page = 16
    q, k, v, rtt, rpi = build_pool(batch, ctx, hq, hk, d, page, planted=False, dev=dev)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    lists, lens = random_lists(batch, hk, ctx, width, dev)
    nf = torch.zeros(batch, dtype=torch.int32, device=dev)
    sm = d ** -0.5
    plan = plan_splits(width, batch * hk, block_size=1, target_programs=2 * sm_count)
    po, plse = alloc_split_buffers(batch, hq, d, plan.num_splits, dev)
    out1, out2 = torch.empty_like(q), torch.empty_like(q)
    lse1, lse2 = (torch.empty(batch, hq, dtype=torch.float32, device=dev) for _ in range(2))
    nr1, nr2 = (torch.empty(batch, hk, dtype=torch.int32, device=dev) for _ in range(2))

    def one():
        sparse_decode(q, k, v, rtt, rpi, seq, lists, lens, nf, block_size=1, sm_scale=sm, epsilon=1.0,
                      out=out1, lse_out=lse1, nread_out=nr1)

    def split():
        sparse_decode_split(q, k, v, rtt, rpi, seq, lists, lens, plan, block_size=1, sm_scale=sm,
                            partial_o_buf=po, partial_lse_buf=plse, out=out2, lse_out=lse2, nread_out=nr2)

    fns = {"one_program": one, "split": split}
    if dev == "cuda":
        from flashinfer_ext.common.dense_decode import FlashInferDenseDecode, paged_kv_table

        dense = FlashInferDenseDecode(hq, hk, d, page, device=dev)
        dense.plan(*paged_kv_table(rtt, rpi.tolist(), [ctx] * batch, page), dtype=q.dtype, sm_scale=sm)
        fns["dense"] = lambda: dense.run(q, k, v)
    t = {}
    for name, fn in fns.items():
        g = graph_of(fn)
        t[name] = timed((lambda: g.replay()) if g is not None else fn, iters=50)
    max_err = float((out1.float() - out2.float()).abs().max())
    read_bytes = 2 * batch * hk * width * d * k.element_size()
    res = dict(shape=shape, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, batch=batch, context=ctx, list_width=width,
               num_splits=plan.num_splits, chunk=plan.chunk, us={n: 1e6 * s for n, s in t.items()},
               split_speedup_vs_one_program=t["one_program"] / t["split"],
               split_time_over_dense=t["split"] / t["dense"] if "dense" in t else float("nan"),
               split_tbps=read_bytes / t["split"] / 1e12, split_fraction_of_peak=read_bytes / t["split"] / peak_bps,
               max_abs_diff_split_vs_one_program=max_err)
    return res


def sweep_case(shape, batch, ctx, width, kind, dev, peak_bps, sm_count, configs) -> list[dict]:
    """The split decode of one case under every ``(tile_tokens, num_warps, num_stages)`` config: us (CUDA-graph
    replays), TB/s of the listed K and V rows, and the max difference from the first config."""
    from dataclasses import replace

    from flashinfer_ext.common.split_decode import alloc_split_buffers, plan_splits, sparse_decode_split

    hq, hk, d = SHAPES[shape]
    q, k, v, rtt, rpi = build_pool(batch, ctx, hq, hk, d, 16, planted=False, dev=dev)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    lists, lens = random_lists(batch, hk, ctx, width, dev)
    lists = torch.sort(lists, dim=2).values.contiguous()  # LoopServe's lists come in runs of ascending positions
    read_bytes = 2 * batch * hk * width * d * k.element_size()
    rows, ref = [], None
    for tile, warps, stages in configs:
        base = plan_splits(width if kind == "eager" else ctx, hk if kind == "invariant" else batch * hk, block_size=1,
                           target_programs=2 * sm_count, tile_tokens=tile)
        plan = replace(base, num_warps=warps, num_stages=stages)
        po, plse = alloc_split_buffers(batch, hq, d, plan.num_splits, dev)
        out = torch.empty_like(q)

        def fn():
            sparse_decode_split(q, k, v, rtt, rpi, seq, lists, lens, plan, block_size=1, sm_scale=d ** -0.5,
                                partial_o_buf=po, partial_lse_buf=plse, out=out)
        try:
            g = graph_of(fn)
            t = timed((lambda: g.replay()) if g is not None else fn, iters=50)
        except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
            rows.append(dict(tile=tile, num_warps=warps, num_stages=stages,
                             error=f"{type(e).__name__}: {e}"[:200]))
            continue
        ref = out.float().clone() if ref is None else ref
        rows.append(dict(tile=tile, num_warps=warps, num_stages=stages, num_splits=plan.num_splits,
                         chunk=plan.chunk, us=1e6 * t, tbps=read_bytes / t / 1e12, fraction_of_peak=read_bytes / t / peak_bps,
                         max_abs_diff=float((out.float() - ref).abs().max())))
    return [dict(shape=shape, batch=batch, context=ctx, list_width=width, plan=kind, **r) for r in rows]


def run_sweep(out: Path, meta: dict, dev: str) -> int:
    from flashinfer_ext.common.split_decode import plan_splits

    default = plan_splits(1, 1, block_size=1, target_programs=1)  # at block size 1 its tile is `sub` entries
    configs = [(t, w, st) for t in SWEEP_TILES for w in SWEEP_WARPS for st in SWEEP_STAGES]
    configs.sort(key=lambda c: c != (default.sub, default.num_warps, default.num_stages))  # default first
    results = []
    for case in SWEEP_CASES:
        rows = sweep_case(*case, dev, meta["peak_bps"], meta["sm_count"], configs)
        results += rows
        ok = [r for r in rows if "error" not in r]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        print(json.dumps(dict(case=case, default_us=ok[0]["us"] if ok else None, best=best)), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_sweep.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = ["# Split-list decode: tile / warps / stages sweep", "", f"- GPU: {meta['gpu']}",
             f"- versions: {meta['versions']}", f"- command: `{meta['command']}`",
             f"- measured peak (1 GiB device copy): {meta['peak_bps'] / 1e12:.2f} TB/s; SMs {meta['sm_count']}",
             "- split + merge replayed from a CUDA graph, median of 50; bf16; sorted random distinct positions", "",
             "| case | plan | config (tile, warps, stages) | splits | us | TB/s (of peak) |", "|---|---|---|---|---|---|"]
    for case in SWEEP_CASES:
        rows = [r for r in results if (r["shape"], r["batch"], r["context"], r["list_width"], r["plan"]) == case
                and "error" not in r]
        for tag, r in (("default", rows[0] if rows else None),
                       ("best", min(rows, key=lambda r: r["us"]) if rows else None)):
            if r is not None:
                lines.append(f"| {case[0]} b{case[1]} ctx {case[2]} lists {case[3]} | {case[4]} | {tag}: "
                             f"{r['tile']}, {r['num_warps']}, {r['num_stages']} | {r['num_splits']} | "
                             f"{r['us']:.1f} | {r['tbps']:.2f} ({r['fraction_of_peak']:.2f}) |")
    (out / "split_sweep.md").write_text("\n".join(lines) + "\n")
    return 0


def write_report(out: Path, meta: dict, results: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_decode.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# Sparse decode over token lists: one program per pair vs split-list vs dense FlashInfer", "",
             f"- GPU: {meta['gpu']}", f"- versions: {meta['versions']}", f"- command: `{meta['command']}`",
             f"- measured peak (1 GiB device copy): {meta['peak_bps'] / 1e12:.2f} TB/s; SMs {meta['sm_count']}",
             "- each kernel replayed from a CUDA graph, median of 50 CUDA-event timings; bf16, random keys, "
             "random distinct positions per (request, KV head); dense = FlashInfer paged decode, page 16, whole "
             "context", "",
             "| shape | batch | context | list width | splits | one program (us) | split (us) | dense (us) | "
             "split speed-up | split / dense | split TB/s (of peak) | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r.get('shape')} | {r.get('batch')} | {r.get('context')} | {r.get('list_width')} | "
                         f"error: {r['error']} |||||||")
            continue
        u = r["us"]
        lines.append(f"| {r['shape']} ({r['num_qo_heads']}/{r['num_kv_heads']} x {r['head_dim']}) | {r['batch']} | "
                     f"{r['context']} | {r['list_width']} | {r['num_splits']} | {u['one_program']:.1f} | "
                     f"{u['split']:.1f} | {u.get('dense', float('nan')):.1f} | "
                     f"{r['split_speedup_vs_one_program']:.2f}x | {r['split_time_over_dense']:.2f} | "
                     f"{r['split_tbps']:.2f} ({r['split_fraction_of_peak']:.2f}) | "
                     f"{r['max_abs_diff_split_vs_one_program']:.1e} |")
    (out / "sparse_decode.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="one tiny case on the CPU (Triton interpreter)")
    ap.add_argument("--sweep", action="store_true", help="GPU: the split kernel's launch configs on testbed shapes")
    args = ap.parse_args(argv)
    import triton

    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if dev == "cpu" and not args.smoke:
        ap.error("no CUDA device: only --smoke runs on the CPU")
    try:
        import flashinfer
        fi_version = flashinfer.__version__
    except ImportError:
        fi_version = "absent"
    meta = dict(command=" ".join(["python"] + sys.argv), gpu=torch.cuda.get_device_name() if dev == "cuda" else
                "CPU (Triton interpreter: timings meaningless)",
                versions=f"torch {torch.__version__}, triton {triton.__version__}, flashinfer {fi_version}, "
                         f"python {platform.python_version()}",
                peak_bps=measure_peak_bw() if dev == "cuda" else float("nan"),
                sm_count=torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4)
    if args.sweep:
        if dev != "cuda":
            ap.error("--sweep needs a CUDA device")
        return run_sweep(args.out, meta, dev)
    results, t0 = [], time.time()
    for shape, batch, ctx, width in (SMOKE if args.smoke else CASES):
        try:
            r = run_case(shape, batch, ctx, width, dev, meta["peak_bps"], meta["sm_count"])
        except Exception as e:  # one failing case must not lose the others
            r = dict(shape=shape, batch=batch, context=ctx, list_width=width, error=f"{type(e).__name__}: {e}")
        print(json.dumps(r), flush=True)
        results.append(r)
        write_report(args.out, meta, results)
    print(f"[sparse_decode_bench] {len(results)} cases in {time.time() - t0:.0f}s -> {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
