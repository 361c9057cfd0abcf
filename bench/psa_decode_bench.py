"""PSA progressive decode kernel vs FlashInfer dense decode, on one GPU.

Measures, per case (Llama-3.1-8B attention shapes: 32 qo / 8 kv heads, d=128, bf16):
time of ``PsaDecodeWrapper.run`` (criticality + sort + progressive decode) and of
``flashinfer.BatchDecodeWithPagedKVCacheWrapper.run``; bytes read (KV of the blocks
read + block metadata) and achieved TB/s against the measured peak (a large device
copy); blocks read; true kept mass (against full attention); and a fixed top-k
(Quest-style, same cuboid ranking, same sink/local blocks) baseline at equal mean kept
mass, as a bytes-read ratio and a time (same kernel, fixed list length). Workloads:
(a) planted power-law structure, (b) Q/K/V captured from SmolLM2-135M on real text
(its own shapes: 9/3 heads, d=64), plus the dense-fallback overhead at 4k context.

Writes ``psa_decode.md``, ``psa_decode.json`` and ``psa_decode.png`` into ``--out``.
Every case runs under try/except: a failure is recorded and the rest still runs.

    python bench/psa_decode_bench.py --out bench/results --quick
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashinfer_ext.block_meta import BlockMetaPool, paged_block_table  # noqa: E402
from flashinfer_ext.config import PsaDecodeConfig  # noqa: E402
from flashinfer_ext.dense_decode import FlashInferDenseDecode, paged_kv_table  # noqa: E402
from flashinfer_ext.psa_decode import PsaDecodeWrapper  # noqa: E402
from flashinfer_ext.sparse_decode import sparse_decode  # noqa: E402

PLANT = dict(alpha=1.2, group_tokens=16, strength=6.0, noise=0.3)  # planted-structure parameters
EPS = 0.95


def timed(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] * 1e-3  # median seconds


def measure_peak_bw():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), iters=10)
    del x, y
    return 2 * (1 << 30) / t


def build_pool(batch, ctx, hq, hk, d, page, planted, seed=0, kv=None, q=None):
    """KV pool on the GPU with shuffled pages; optional planted power-law mass over 16-token groups."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_req = -(-ctx // page)
    num_pages = batch * pages_per_req
    perm = torch.randperm(num_pages, device="cuda", generator=g)
    req_to_token = (perm.view(batch, pages_per_req, 1) * page
                    + torch.arange(page, device="cuda")).view(batch, -1)[:, :ctx].to(torch.int32).contiguous()
    if kv is None:
        k = torch.randn(num_pages * page, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        if planted:
            gt = PLANT["group_tokens"]
            ng = -(-ctx // gt)
            grp = hq // hk
            for r in range(batch):
                rank = torch.randperm(ng, device="cuda", generator=g).float()
                strength = (1.0 / (1.0 + rank) ** PLANT["alpha"]).repeat_interleave(gt)[:ctx]
                qdir = q[r].float().view(hk, grp, d).mean(1)
                qdir = qdir / qdir.norm(dim=-1, keepdim=True)
                slots = req_to_token[r].long()
                c = PLANT["strength"] * d ** 0.25
                k[slots] = (PLANT["noise"] * k[slots].float()
                            + c * strength[:, None, None] * qdir[None]).to(torch.bfloat16)
    else:
        k, v = kv
    rpi = torch.arange(batch, dtype=torch.int32, device="cuda")
    return q, k, v, req_to_token, rpi


def kept_mass(q, k, req_to_token, seq_lens_host, order, nread, page, sm_scale):
    """True kept mass per (request, qo head) and per-pair block-mass cumsum along the order."""
    batch, hq, d = q.shape
    hk = k.shape[1]
    grp = hq // hk
    kept, cums = [], []
    for r in range(batch):
        L = seq_lens_host[r]
        kk = k[req_to_token[r, :L].long()].float()  # [L, hk, d]
        s = torch.einsum("hgd,lhd->hgl", q[r].float().view(hk, grp, d), kk) * sm_scale
        p = torch.softmax(s, -1)
        nb = -(-L // page)
        p = torch.nn.functional.pad(p, (0, nb * page - L)).view(hk, grp, nb, page).sum(-1)  # [hk, grp, nb]
        o = order[r, :, :nb]
        pb = torch.gather(p, 2, o[:, None, :].expand(hk, grp, nb))
        cum = pb.cumsum(-1)
        idx = (nread[r].long() - 1).clamp(min=0)[:, None, None].expand(hk, grp, 1)
        kept.append(torch.gather(cum, 2, idx).view(hq))
        cums.append(cum.view(hq, nb))
    return torch.stack(kept), cums


def quest_k_at_equal_mass(cums, target_mean):
    """Smallest fixed k whose mean kept mass (over all (request, qo head)) >= target_mean."""
    nbmax = max(c.shape[1] for c in cums)
    full = torch.stack([torch.nn.functional.pad(c, (0, nbmax - c.shape[1]), value=1.0) if c.shape[1] < nbmax
                        else c for c in cums])
    for c, f in zip(cums, full):  # pad with the request's total (its last cumsum value)
        f[:, c.shape[1]:] = c[:, -1:]
    mean_k = full.mean(dim=(0, 1))  # [nbmax]
    ok = (mean_k >= target_mean - 1e-6).nonzero()
    return int(ok[0]) + 1 if ok.numel() else nbmax


def run_case(name, batch, ctx, page, planted=True, capture=None, hq=32, hk=8, d=128, eps=EPS, seed=0,
             with_quest=True):
    torch.cuda.empty_cache()
    if capture is not None:
        q, k, v, req_to_token, rpi, seq_host = capture
        batch, hq, d = q.shape
        hk = k.shape[1]
    else:
        q, k, v, req_to_token, rpi = build_pool(batch, ctx, hq, hk, d, page, planted, seed)
        seq_host = [ctx] * batch
    seq_lens = torch.tensor(seq_host, dtype=torch.int32, device="cuda")
    sm_scale = d ** -0.5
    nb = -(-max(seq_host) // page)
    table = paged_block_table(req_to_token, rpi, page, nb)
    num_rows = k.shape[0] // page
    meta = BlockMetaPool(1, num_rows, hk, d, page, dtype=torch.bfloat16, device="cuda")
    if capture is None:
        meta.update(0, k, req_to_token, rpi, table, torch.zeros_like(seq_lens), seq_lens, nb)
    else:  # requests share pages (same layer): write shorter ones first so full pages win
        for r in sorted(range(batch), key=lambda i: seq_host[i]):
            meta.update(0, k, req_to_token, rpi[r:r + 1], table[r:r + 1], torch.zeros_like(seq_lens[r:r + 1]),
                        seq_lens[r:r + 1], nb)
    cfg = PsaDecodeConfig(epsilon=eps, micro_batch_blocks=8, sink_blocks=1, local_blocks=2, max_blocks=1 << 20)
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=page,
                         max_batch_size=batch, max_blocks_per_req=nb, device="cuda", sm_scale=sm_scale)
    w.plan(req_to_token, rpi, seq_lens, table)
    ml = meta.layer(0)
    t_psa = timed(lambda: w.run(q, k, v, *ml))
    o, lse, nread = w.run(q, k, v, *ml)
    torch.cuda.synchronize()
    try:
        dense = FlashInferDenseDecode(hq, hk, d, page)
        dense.plan(*paged_kv_table(req_to_token, rpi.tolist(), seq_host, page), sm_scale=sm_scale)
        t_dense = timed(lambda: dense.run(q, k, v))
        do, _ = dense.run(q, k, v)
    except ImportError:  # no flashinfer: PSA numbers only, dense columns NaN
        dense, t_dense, do = None, float("nan"), torch.full_like(o, float("nan"))
    blk_bytes = page * d * 2 * 2  # K + V, bf16, one KV head
    total_blocks = sum(-(-L // page) for L in seq_host) * hk
    blocks_read = int(nread.sum())
    meta_bytes = total_blocks * 2 * d * 2  # kmin + kmax, bf16
    psa_bytes = blocks_read * blk_bytes + meta_bytes
    dense_bytes = sum(seq_host) * hk * d * 2 * 2
    kept, cums = kept_mass(q, k, req_to_token, seq_host, w.order, nread, page, sm_scale)
    res = dict(case=name, batch=batch, ctx=max(seq_host), page=page, heads=f"{hq}/{hk}", head_dim=d, eps=eps,
               planted=planted, t_psa_us=t_psa * 1e6, t_dense_us=t_dense * 1e6, speedup=t_dense / t_psa,
               blocks_read=blocks_read, blocks_total=total_blocks, read_frac=blocks_read / total_blocks,
               psa_bytes=psa_bytes, dense_bytes=dense_bytes, psa_tbps=psa_bytes / t_psa / 1e12,
               dense_tbps=dense_bytes / t_dense / 1e12, kept_mean=float(kept.mean()), kept_min=float(kept.min()),
               kept_ge_eps=float((kept >= eps).float().mean()),
               max_abs_err_vs_dense=float((o.float() - do.float()).abs().max()))
    if with_quest:
        kq = quest_k_at_equal_mass(cums, res["kept_mean"])
        n_forced = min(nb, 3)
        nb_r = (seq_lens + page - 1) // page
        lens = torch.clamp(nb_r, max=kq)[:, None].expand(batch, hk).to(torch.int32).contiguous()
        forced = torch.full((batch,), n_forced, dtype=torch.int32, device="cuda")
        order = w.order.clone()
        t_q = timed(lambda: sparse_decode(q, k, v, req_to_token, rpi, seq_lens, order, lens, forced,
                                          block_size=page, sm_scale=sm_scale, epsilon=1.0))
        quest_blocks = int(lens.sum())
        res.update(quest_k=kq, quest_blocks=quest_blocks, quest_over_psa_bytes=(quest_blocks * blk_bytes + meta_bytes)
                   / psa_bytes, t_quest_us=t_q * 1e6)
    del meta, w, dense, k, v
    return res


def capture_smollm(num_tokens, layers, positions):
    sys.path.insert(0, str(ROOT / "bench"))
    from psa_capture import capture_qkv  # noqa: E402

    cap = capture_qkv(num_tokens=num_tokens, layers=layers, device="cuda")
    L = num_tokens
    k = torch.cat([cap[i][1] for i in layers]).bfloat16().cuda()
    v = torch.cat([cap[i][2] for i in layers]).bfloat16().cuda()
    reqs = [(li, t) for li in range(len(layers)) for t in positions]
    q = torch.stack([cap[layers[li]][0][t] for li, t in reqs]).bfloat16().cuda()
    rows = torch.stack([li * L + torch.arange(L) for li, _ in reqs]).to(torch.int32).cuda()
    return q, k, v, rows, torch.arange(len(reqs), dtype=torch.int32, device="cuda"), [t + 1 for _, t in reqs]


def write_report(out: Path, meta: dict, results: list):
    out.mkdir(parents=True, exist_ok=True)
    (out / "psa_decode.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = ["# PSA progressive decode vs FlashInfer dense decode", "",
             f"- command: `{meta['command']}`", f"- GPU: {meta['gpu']}; peak copy bandwidth "
             f"{meta.get('peak_tbps', float('nan')):.2f} TB/s (1 GiB device copy, read+write)",
             f"- versions: {meta['versions']}", f"- planted structure: {meta['plant']}",
             f"- PSA: eps={EPS}, micro-batch 8 blocks, sink 1, local 2 blocks, cuboid criticality, group max; "
             "metadata bf16; times are medians of 20 CUDA-event timed runs of one layer",
             "- bytes: PSA = K+V of blocks read + kmin/kmax of all blocks; dense = all K+V", "",
             "| case | batch | ctx | page | heads | t PSA us | t dense us | dense/PSA | read frac | kept mean |"
             " kept>=eps | PSA TB/s | dense TB/s | Quest k | Quest/PSA bytes | t Quest us | err vs dense |",
             "|" + "---|" * 17]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | FAILED: {r['error'][:120]} |" + " |" * 15)
            continue
        lines.append(
            f"| {r['case']} | {r['batch']} | {r['ctx']} | {r['page']} | {r['heads']} | {r['t_psa_us']:.1f} | "
            f"{r['t_dense_us']:.1f} | {r['speedup']:.2f} | {r['read_frac']:.3f} | {r['kept_mean']:.4f} | "
            f"{r['kept_ge_eps']:.3f} | {r['psa_tbps']:.2f} | {r['dense_tbps']:.2f} | {r.get('quest_k', '-')} | "
            f"{r.get('quest_over_psa_bytes', float('nan')):.2f} | {r.get('t_quest_us', float('nan')):.1f} | "
            f"{r['max_abs_err_vs_dense']:.3g} |")
    (out / "psa_decode.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for b in sorted({r["batch"] for r in results if r.get("case") == "planted" and "error" not in r}):
            pts = sorted((r["ctx"], r["speedup"]) for r in results
                         if r.get("case") == "planted" and r["batch"] == b and r["page"] == 16 and "error" not in r
                         and math.isfinite(r["speedup"]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens), page 16")
        ax.set_ylabel("FlashInfer dense time / PSA time")
        ax.set_title(f"PSA decode (eps={EPS}, planted) vs dense, {meta['gpu']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "psa_decode.png", dpi=120)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="a subset of cases that fits ~3 minutes")
    ap.add_argument("--no-smollm", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    import triton

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
        print("flashinfer is not installed: dense baseline columns will be NaN")

    meta = dict(command=" ".join([sys.executable.split("/")[-1]] + sys.argv), gpu=torch.cuda.get_device_name(),
                versions=f"torch {torch.__version__}, triton {triton.__version__}, flashinfer "
                         f"{getattr(flashinfer, '__version__', '?')}, python {platform.python_version()}",
                plant=PLANT, shapes="Llama-3.1-8B attention: 32 qo / 8 kv heads, head_dim 128, bf16")
    results = []
    try:
        meta["peak_tbps"] = measure_peak_bw() / 1e12
    except Exception as e:
        meta["peak_tbps"] = float("nan")
        print("peak measurement failed:", e)
    if args.quick:
        grid = [(1, 32768, 16), (8, 32768, 16), (32, 8192, 16), (8, 131072, 16), (8, 32768, 32), (8, 32768, 64)]
        fallback = [8]
    else:
        grid = [(b, c, p) for p in (16, 32, 64) for b in (1, 8, 32) for c in (8192, 32768, 131072)]
        fallback = [1, 8, 32]
    cases = [("planted", dict(batch=b, ctx=c, page=p)) for b, c, p in grid]
    cases += [("fallback eps=1 (4k)", dict(batch=b, ctx=4096, page=16, eps=1.0, with_quest=False)) for b in fallback]
    cases += [("fallback random keys (4k)", dict(batch=b, ctx=4096, page=16, planted=False)) for b in fallback]
    for name, kw in cases:
        try:
            r = run_case(name, **kw)
            print(json.dumps(r), flush=True)
            results.append(r)
        except Exception as e:
            traceback.print_exc()
            results.append(dict(case=name, **kw, error=f"{type(e).__name__}: {e}"))
        write_report(args.out, meta, results)
    if not args.no_smollm:
        for page in (16,):
            try:
                cap = capture_smollm(8192, (3, 9, 15, 21, 27), (4095, 6000, 8191))
                r = run_case("smollm2 real text", 0, 0, page, capture=cap)
                print(json.dumps(r), flush=True)
                results.append(r)
            except Exception as e:
                traceback.print_exc()
                results.append(dict(case="smollm2 real text", page=page, error=f"{type(e).__name__}: {e}"))
    meta["wall_s"] = time.time() - t0
    write_report(args.out, meta, results)
    print(f"wrote {args.out}/psa_decode.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
