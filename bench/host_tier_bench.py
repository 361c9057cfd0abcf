"""Host tier transfer benchmark (SparseServe FlashH2D / FlashD2H) on one GPU.

Gather (host -> GPU cache), per page size 16/32/64 tokens, Llama-3.1-8B KV shapes (8 KV heads,
head_dim 128, bf16; one unit = one (layer, block, KV head) of K and V = 2 x page x 128 x 2 bytes),
2k/8k/16k units selected at random (without replacement) out of a ``--pool-gib`` pinned host pool:
  (i)   the fused gather (``flashinfer_ext.host_tier.host_transfer.HostGather``: one Triton launch through UVA;
        the path that actually ran is reported),
  (ii)  per-block ``cudaMemcpyAsync`` (a python loop of ``dst[i].copy_(src[j], non_blocking=True)``,
        stopped after ``--per-block-cap-s`` seconds; its rate is over the copies it did),
  (iii) the contiguous pinned host -> device bandwidth (one large copy, best of 5).
Save (GPU cache -> host), per page size, 8k units: CPU-assisted (``HostSave.save_slots``: pack on
the GPU, one D2H copy into pinned staging, thread scatter; timed to the end of the scatter) vs
per-block D2H copies (time-capped). Overlap: the fused gather and the CPU-assisted save at page 16
beside a bf16 matmul loop on the compute stream. The first gather and save of each case are checked bit-exactly
against the source (a sample is enough to catch a wrong path; the GPU tests check everything).

Writes ``host_tier.md`` and ``host_tier.json`` into ``--out``. Headline keys (computed, never typed):
``gather_fraction_of_h2d`` = fused gather GB/s at page 16 and the largest count / contiguous H2D GB/s;
``concurrency_ratio_vs_dense``: null with ``concurrency_ratio_vs_dense_reason`` here; the end-to-end run
(``bench/host_tier_concurrency.py --merge-into OUT/host_tier.json``) sets it, and a re-run of this
script keeps the keys that run merged.
``--smoke``: tiny shapes on the CPU through the Triton interpreter (timings meaningless), so a CPU
test runs the script end to end.

    python bench/host_tier_bench.py --out bench/results          # ~1 minute on an H100
    python bench/host_tier_bench.py --out /tmp/ht --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # kernels run under the Triton interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashinfer_ext.host_tier.host_transfer import HostGather, HostSave  # noqa: E402

KV_HEADS, HEAD_DIM, DTYPE = 8, 128, torch.bfloat16


class _Clock:
    """Elapsed seconds of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def measure_h2d(pool_bytes: torch.Tensor, dev: str, nbytes: int) -> float:
    """Best of 5 contiguous pinned host -> device copies of ``nbytes``, bytes/s."""
    src = pool_bytes[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(6):
        with _Clock(dev == "cuda") as c:
            dst.copy_(src, non_blocking=True)
        best = min(best, c.s)
    return nbytes / best


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())


def gather_case(pool_bytes, dev, page, n, reps, cap_s, gen, chunk_words=2048, num_warps=4,
                per_block=True) -> dict:
    cuda = dev == "cuda"
    unit_elems = 2 * page * HEAD_DIM
    unit_bytes = unit_elems * 2
    src = pool_bytes[: (pool_bytes.numel() // unit_bytes) * unit_bytes].view(DTYPE).view(-1, unit_elems)
    num_units = src.shape[0]
    n = min(n, num_units)
    cache = torch.zeros((n, unit_elems), dtype=DTYPE, device=dev)
    sel = torch.randperm(num_units, generator=gen)[:n]
    slots = torch.randperm(n, generator=gen)
    s_ids, d_ids = sel.to(torch.int32).to(dev), slots.to(torch.int32).to(dev)
    g = HostGather(src, cache, max_rows=n, chunk_words=chunk_words, num_warps=num_warps)
    g.run(s_ids, d_ids)
    g.wait()
    _sync(cuda)
    k = min(n, 512)
    exact = _bits_equal(cache[slots[:k].to(dev)], src[sel[:k]])
    times = []
    for _ in range(reps):
        with _Clock(cuda) as c:
            g.run(s_ids, d_ids)
            g.wait()
        times.append(c.s)
    fused_s = sorted(times)[len(times) // 2]
    shape = dict(kind="gather" if per_block else "gather_sweep", page=page, units=n, unit_bytes=unit_bytes,
                 chunk_words=chunk_words, num_warps=num_warps, pool_units=num_units, bytes=n * unit_bytes,
                 path=g.path, probe_errors=g.probe_errors, bit_exact_sample=exact,
                 fused_s=fused_s, fused_bps=n * unit_bytes / fused_s)
    if not per_block:
        return shape
    # per-block copies, time-capped
    sl, dl = sel.tolist(), slots.tolist()
    _sync(cuda)
    t0 = time.perf_counter()
    done = 0
    for j in range(n):
        cache[dl[j]].copy_(src[sl[j]], non_blocking=True)
        done += 1
        if (done & 63) == 0 and time.perf_counter() - t0 > cap_s:
            break
    _sync(cuda)
    pb_s = time.perf_counter() - t0
    return dict(shape, per_block_copies=done, per_block_s=pb_s, per_block_bps=done * unit_bytes / pb_s)


def save_case(pool_bytes, dev, page, n, reps, cap_s, gen, threads) -> dict:
    cuda = dev == "cuda"
    unit_elems = 2 * page * HEAD_DIM
    unit_bytes = unit_elems * 2
    host = pool_bytes[: (pool_bytes.numel() // unit_bytes) * unit_bytes].view(DTYPE).view(-1, unit_elems)
    n = min(n, host.shape[0])
    cache = torch.randn((n, unit_elems), generator=None, device=dev).to(DTYPE)
    slots = torch.randperm(n, generator=gen).to(dev)
    units = torch.randperm(host.shape[0], generator=gen)[:n]
    saver = HostSave(host, max_rows=n, device=dev, num_threads=threads)
    try:
        saver.save_slots(cache, slots, units).result()
        k = min(n, 512)
        exact = _bits_equal(host[units[:k]], cache[slots[:k]])
        times = []
        for _ in range(reps):
            _sync(cuda)
            t0 = time.perf_counter()
            saver.save_slots(cache, slots, units).result()
            times.append(time.perf_counter() - t0)
        cpu_s = sorted(times)[len(times) // 2]
    finally:
        saver.close()
    sl, ul = slots.tolist(), units.tolist()
    _sync(cuda)
    t0 = time.perf_counter()
    done = 0
    for j in range(n):
        host[ul[j]].copy_(cache[sl[j]], non_blocking=True)
        done += 1
        if (done & 63) == 0 and time.perf_counter() - t0 > cap_s:
            break
    _sync(cuda)
    pb_s = time.perf_counter() - t0
    return dict(kind="save", page=page, units=n, unit_bytes=unit_bytes, bytes=n * unit_bytes, threads=threads,
                bit_exact_sample=exact, cpu_assisted_s=cpu_s, cpu_assisted_bps=n * unit_bytes / cpu_s,
                per_block_copies=done, per_block_s=pb_s, per_block_bps=done * unit_bytes / pb_s)


def overlap_case(pool_bytes, dev, page, n, gen, mm_size: int, mm_iters: int) -> dict:
    """Fused gather (own stream) and CPU-assisted save (own stream + threads) running beside a bf16
    matmul loop on the current stream: wall time of both vs each alone.
    ``overlap = (t_alone_sum - t_both) / min(t_mm, t_transfer)`` (1 = fully hidden, 0 = serialised)."""
    cuda = dev == "cuda"
    unit_elems = 2 * page * HEAD_DIM
    unit_bytes = unit_elems * 2
    src = pool_bytes[: (pool_bytes.numel() // unit_bytes) * unit_bytes].view(DTYPE).view(-1, unit_elems)
    n = min(n, src.shape[0])
    cache = torch.zeros((n, unit_elems), dtype=DTYPE, device=dev)
    s_ids = torch.randperm(src.shape[0], generator=gen)[:n].to(torch.int32).to(dev)
    d_ids = torch.arange(n, dtype=torch.int32, device=dev)
    a = torch.randn((mm_size, mm_size), device=dev).to(DTYPE)
    g = HostGather(src, cache, max_rows=n)
    saver = HostSave(src, max_rows=n, device=dev)
    units = torch.randperm(src.shape[0], generator=gen)[:n]

    def mm():
        x = a
        for _ in range(mm_iters):
            x = a @ x
        return x

    def gather():  # issued before the matmul; the final device synchronize waits for its stream
        g.run(s_ids, d_ids)

    def save():
        return saver.save_slots(cache, d_ids, units)

    def wall(fn_list):
        _sync(cuda)
        t = time.perf_counter()
        futs = [f() for f in fn_list]
        for f in futs:
            if hasattr(f, "result"):
                f.result()
        _sync(cuda)
        return time.perf_counter() - t

    try:
        for f in (mm, gather, save):  # warm up (compile, thread pool)
            wall([f])
        out = dict(kind="overlap", page=page, units=n, bytes=n * unit_bytes, matmul=f"{mm_iters} x bf16 {mm_size}^2",
                   path=g.path)
        t_mm = min(wall([mm]) for _ in range(3))
        for name, fn in (("gather", gather), ("save", save)):
            t_x = min(wall([fn]) for _ in range(3))
            t_both = min(wall([fn, mm]) for _ in range(3))
            out.update({f"{name}_alone_s": t_x, f"{name}_with_matmul_s": t_both,
                        f"{name}_overlap": (t_mm + t_x - t_both) / min(t_mm, t_x)})
        out["matmul_alone_s"] = t_mm
        return out
    finally:
        saver.close()


def summary(meta: dict, results: list[dict]) -> dict:
    h2d = meta.get("h2d_bps")
    gathers = [r for r in results if r.get("kind") == "gather" and "error" not in r]
    head = [r for r in gathers if r["page"] == min(meta["pages"])]
    head = max(head, key=lambda r: r["units"]) if head else None
    frac = head["fused_bps"] / h2d if head and h2d else None
    saves = [r for r in results if r.get("kind") == "save" and "error" not in r]
    sweep = [r for r in results if r.get("kind") == "gather_sweep" and "error" not in r]
    best = max(sweep, key=lambda r: r["fused_bps"]) if sweep else None
    return {
        "gpu": meta["gpu"],
        "gather_fraction_of_h2d": frac,
        "gather_fraction_of_h2d_case": None if head is None else f"page {head['page']}, {head['units']} units",
        "gather_path": head["path"] if head else None,
        "h2d_gbps": None if not h2d else h2d / 1e9,
        "fused_gather_gbps_max": max(r["fused_bps"] for r in gathers) / 1e9 if gathers else None,
        "fused_over_per_block_min": min((r["fused_bps"] / r["per_block_bps"] for r in gathers), default=None),
        "save_cpu_assisted_over_per_block_min": min((r["cpu_assisted_bps"] / r["per_block_bps"] for r in saves),
                                                    default=None),
        "all_samples_bit_exact": all(r["bit_exact_sample"] for r in gathers + saves + sweep)
        if gathers + saves else None,
        "sweep_best": None if not best else f"chunk_words {best['chunk_words']}, num_warps {best['num_warps']}: "
                                            f"{best['fused_bps'] / 1e9:.2f} GB/s",
        "gather_fraction_of_h2d_sweep_best": best["fused_bps"] / h2d if best and h2d else None,
        "concurrency_ratio_vs_dense": None,
        "concurrency_ratio_vs_dense_reason": "not measured by this transfer benchmark: the end-to-end "
                                             "serving comparison is bench/host_tier_concurrency.py "
                                             "(--merge-into this file sets it)",
        "gather_overlap_with_matmul": next((r["gather_overlap"] for r in results
                                            if r.get("kind") == "overlap" and "error" not in r), None),
        "save_overlap_with_matmul": next((r["save_overlap"] for r in results
                                          if r.get("kind") == "overlap" and "error" not in r), None),
        "errors": [f"{r.get('kind')} page {r.get('page')}: {r['error']}" for r in results if "error" in r],
    }


CONCURRENCY_KEYS = ("concurrency_ratio_vs_dense", "concurrency_ratio_vs_dense_reason",
                    "hicache_concurrency_ratio_vs_dense", "hicache_concurrency_ratio_vs_dense_reason",
                    "throughput_ratio_vs_dense", "hicache_throughput_ratio_vs_dense", "concurrency")


def _kept_concurrency(path: Path) -> dict:
    """The end-to-end keys that ``bench/host_tier_concurrency.py --merge-into`` wrote into an existing
    ``host_tier.json`` (marked by its ``concurrency`` block): a re-run of this benchmark keeps them."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or "concurrency" not in old:
        return {}
    return {k: old[k] for k in CONCURRENCY_KEYS if k in old}


def write_report(out: Path, meta: dict, results: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    top = summary(meta, results)
    top.update(_kept_concurrency(out / "host_tier.json"))
    (out / "host_tier.json").write_text(json.dumps(dict(**top, meta=meta, results=results), indent=1))
    gb = 1e9
    h2d_txt = "n/a (" + meta.get("h2d_error", "not measured") + ")" if not meta.get("h2d_bps") \
        else f"{meta['h2d_bps'] / gb:.2f} GB/s"
    lines = ["# Host tier transfers (FlashH2D gather, FlashD2H save)", "",
             f"- command: `{meta['command']}`", f"- GPU: {meta['gpu']}", f"- versions: {meta['versions']}",
             f"- shapes: {meta['shapes']}", f"- pinned pool: {meta['pool_gib']:.3g} GiB; contiguous H2D "
             f"{h2d_txt} (best of 5, {meta['h2d_bytes'] >> 20} MiB)",
             f"- wall time: {meta.get('wall_s', float('nan')):.1f} s", "",
             "## Gather (host -> GPU cache)", "",
             "| page | units | MiB | path | fused GB/s | fraction of H2D | per-block GB/s (copies) | fused / per-block | bit-exact sample |",
             "|---|---|---|---|---|---|---|---|---|"]
    h2d = meta.get("h2d_bps") or float("nan")
    for r in results:
        if r.get("kind") != "gather":
            continue
        if "error" in r:
            lines.append(f"| {r['page']} | {r.get('units')} | | error: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['page']} | {r['units']} | {r['bytes'] / 2**20:.0f} | {r['path']} | "
                     f"{r['fused_bps'] / gb:.2f} | {r['fused_bps'] / h2d:.2f} | {r['per_block_bps'] / gb:.2f} "
                     f"({r['per_block_copies']}) | {r['fused_bps'] / r['per_block_bps']:.1f}x | {r['bit_exact_sample']} |")
    lines += ["", "## Gather launch-shape sweep (smallest page, largest count; default 2048 words x 4 warps; a chunk is capped at one row)", "",
              "| chunk words | warps | units | fused GB/s | fraction of H2D | bit-exact sample |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("kind") != "gather_sweep":
            continue
        if "error" in r:
            lines.append(f"| {r.get('chunk_words')} | {r.get('num_warps')} | | error: {r['error']} | | |")
            continue
        lines.append(f"| {r['chunk_words']} | {r['num_warps']} | {r['units']} | {r['fused_bps'] / gb:.2f} | "
                     f"{r['fused_bps'] / h2d:.2f} | {r['bit_exact_sample']} |")
    ov = [r for r in results if r.get("kind") == "overlap"]
    if ov:
        lines += ["", "## Overlap with compute (transfer on its own stream beside a matmul loop)", "",
                  "| page | units | matmul | matmul alone ms | gather alone / with matmul ms | gather overlap | "
                  "save alone / with matmul ms | save overlap |", "|---|---|---|---|---|---|---|---|"]
        for r in ov:
            if "error" in r:
                lines.append(f"| {r['page']} | {r.get('units')} | error: {r['error']} | | | | | |")
                continue
            lines.append(f"| {r['page']} | {r['units']} | {r['matmul']} | {r['matmul_alone_s'] * 1e3:.2f} | "
                         f"{r['gather_alone_s'] * 1e3:.2f} / {r['gather_with_matmul_s'] * 1e3:.2f} | "
                         f"{r['gather_overlap']:.2f} | {r['save_alone_s'] * 1e3:.2f} / "
                         f"{r['save_with_matmul_s'] * 1e3:.2f} | {r['save_overlap']:.2f} |")
    lines += ["", "## Save (GPU cache -> host)", "",
              "| page | units | MiB | threads | CPU-assisted GB/s | per-block D2H GB/s (copies) | ratio | bit-exact sample |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("kind") != "save":
            continue
        if "error" in r:
            lines.append(f"| {r['page']} | {r.get('units')} | | | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['page']} | {r['units']} | {r['bytes'] / 2**20:.0f} | {r['threads']} | "
                     f"{r['cpu_assisted_bps'] / gb:.2f} | {r['per_block_bps'] / gb:.2f} ({r['per_block_copies']}) | "
                     f"{r['cpu_assisted_bps'] / r['per_block_bps']:.1f}x | {r['bit_exact_sample']} |")
    lines += ["", "## Summary", "", "```", json.dumps(top, indent=1), "```", ""]
    (out / "host_tier.md").write_text("\n".join(lines))
    return top


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="pinned host pool size (default 4)")
    ap.add_argument("--per-block-cap-s", type=float, default=1.5, help="time cap of each per-block loop")
    ap.add_argument("--save-threads", type=int, default=4)
    args = ap.parse_args()
    t0 = time.time()
    import triton

    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    if args.smoke:
        pool_bytes_n, pages, counts, save_n, reps = 1 << 20, (16,), (8, 33), 16, 2
    else:
        pool_bytes_n, pages, counts, save_n, reps = int(args.pool_gib * (1 << 30)), (16, 32, 64), \
            (2048, 8192, 16384), 8192, 10
    meta = dict(command=" ".join([Path(sys.executable).name] + sys.argv),
                gpu=torch.cuda.get_device_name() if cuda else
                f"none (CPU smoke, Triton interpreter: timings meaningless; {platform.processor() or 'cpu'})",
                versions=f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"
                         + (f", cuda {torch.version.cuda}" if cuda else ""),
                shapes=f"Llama-3.1-8B KV: {KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16; unit = one (layer, "
                       f"block, KV head) of K and V", pool_gib=pool_bytes_n / 2**30, pages=list(pages),
                counts=list(counts))
    t_alloc = time.perf_counter()
    pool_bytes = torch.empty(pool_bytes_n, dtype=torch.uint8, pin_memory=cuda)
    pool_bytes[::4096].random_(0, 255)  # touch every page (and vary the content) without a full fill
    meta["pool_alloc_s"] = time.perf_counter() - t_alloc
    meta["h2d_bytes"] = min(pool_bytes_n, 1 << 30)
    results: list[dict] = []
    meta["h2d_bps"] = None
    try:
        meta["h2d_bps"] = measure_h2d(pool_bytes, dev, meta["h2d_bytes"])
    except Exception as e:
        traceback.print_exc()
        meta["h2d_error"] = f"{type(e).__name__}: {e}"
    gen = torch.Generator().manual_seed(0)
    for page in pages:
        for n in counts:
            try:
                r = gather_case(pool_bytes, dev, page, n, reps, args.per_block_cap_s, gen)
            except Exception as e:
                traceback.print_exc()
                r = dict(kind="gather", page=page, units=n, error=f"{type(e).__name__}: {e}")
            print(json.dumps(r), flush=True)
            results.append(r)
            write_report(args.out, meta, results)
    sweep = ((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (2048, 16)) if not args.smoke else ((256, 2),)
    for cw, nw in sweep:
        try:
            r = gather_case(pool_bytes, dev, pages[0], counts[-1], reps, 0.0, gen, chunk_words=cw, num_warps=nw,
                            per_block=False)
        except Exception as e:
            traceback.print_exc()
            r = dict(kind="gather_sweep", page=pages[0], units=counts[-1], chunk_words=cw, num_warps=nw,
                     error=f"{type(e).__name__}: {e}")
        print(json.dumps(r), flush=True)
        results.append(r)
    for page in pages:
        try:
            r = save_case(pool_bytes, dev, page, save_n, max(2, reps // 2), args.per_block_cap_s, gen,
                          args.save_threads)
        except Exception as e:
            traceback.print_exc()
            r = dict(kind="save", page=page, units=save_n, error=f"{type(e).__name__}: {e}")
        print(json.dumps(r), flush=True)
        results.append(r)
    try:
        r = overlap_case(pool_bytes, dev, pages[0], counts[-1], gen, mm_size=64 if args.smoke else 4096,
                         mm_iters=2 if args.smoke else 20)
    except Exception as e:
        traceback.print_exc()
        r = dict(kind="overlap", page=pages[0], units=counts[-1], error=f"{type(e).__name__}: {e}")
    print(json.dumps(r), flush=True)
    results.append(r)
    meta["wall_s"] = time.time() - t0
    top = write_report(args.out, meta, results)
    print(json.dumps(top))
    print(f"wrote {args.out}/host_tier.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
