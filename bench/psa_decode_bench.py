"""PSA progressive decode kernel vs FlashInfer dense decode, on one GPU.

Measures, per case (Llama-3.1-8B attention shapes: 32 qo / 8 kv heads, d=128, bf16):
time of one layer of ``PsaDecodeWrapper.run`` (criticality + sort + bound suffix + waves of
chunk attention and merge), replayed from a CUDA graph as the server runs it (eager time
too), and of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper.run``; bytes read (KV of the
blocks the kernels actually read, incl. the over-read of the last wave, + the metadata the
criticality pass reads for all blocks: kmin, kmax and kmean with the default mean rank order) and
achieved TB/s against the measured peak (a large device copy); blocks in the result; true kept mass (against full attention); a fixed top-k (Quest-style, same
ranking, same sink/local blocks) baseline at equal mean kept mass, as a bytes
ratio and a time (same wave kernels, list capped at k); and the server's short-context
path (dense FlashInfer + the block-metadata update it keeps doing below ``min_context``).

Workloads: (a) planted structure (:func:`plant_structure`, parameters in ``PLANT``),
(b) Q/K/V captured from SmolLM2-135M on real text (its own shapes: 9/3 heads, d=64),
(c) ``testbed real``: Q/K/V captured from the 32k testbed model (SmolLM2-135M + YaRN) on its own
~16k and ~32k needle prompts (:mod:`bench.real_capture`), decode at 3 positions near the end x 5
layers (run when ``--testbed-model`` exists); they give the summary keys ``real_16k`` /
``real_32k`` = {read_fraction, speedup_vs_dense, bytes_ratio_topk_over_psa, ...}. The same pools
feed PSA, dense and top-k.

Writes ``psa_decode.md``, ``psa_decode.json`` (top-level summary keys + every row) and
``psa_decode.png`` into ``--out``. Every case runs under try/except: a failure is recorded
and the rest still runs. ``--smoke`` runs two tiny cases on the CPU (Triton interpreter, no
FlashInfer, timings meaningless) to check the script end to end.

    python bench/psa_decode_bench.py --out bench/results            # full, ~4 min on an H100
    python bench/psa_decode_bench.py --out /tmp/b --quick           # subset
    python bench/psa_decode_bench.py --out bench/results --real-only \
        --testbed-model /tmp/models/SmolLM2-135M-Instruct-32k
        # only (c), merged into the psa_decode.json already in --out (~1 min on an H100)
    python bench/psa_decode_bench.py --out /tmp/b --real-only --real-tokens 1024,2048   # (c) tiny, on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench import psa_plans, real_capture  # noqa: E402
from bench.timing import timed  # noqa: E402
from flashinfer_ext.psa.block_meta import BlockMetaPool, paged_block_table  # noqa: E402
from flashinfer_ext.psa.key_sketch import KeySketchPool  # noqa: E402
from flashinfer_ext.psa.config import PsaDecodeConfig  # noqa: E402
from flashinfer_ext.common.dense_decode import FlashInferDenseDecode, paged_kv_table  # noqa: E402
from flashinfer_ext.psa.decode import PsaDecodeWrapper  # noqa: E402

# Planted structure: per (request, KV head) the 16-token groups get a random rank i (a random
# permutation) and every query head of the group sees the logit offset top_logit - alpha*ln(1+i)
# on them (mass ~ (1+i)^-alpha: a power law in *mass*, so a few groups hold most of it; with
# alpha = 2, 95 % of the mass sits in ~13 groups whatever the context), plus per-token noise
# (key noise std `noise` -> logit noise std ~ noise nats). The old structure (alpha 1.2 on the
# *logit*) left ~70 % of the mass in one group and a flat tail that made 95 % unreachable without
# reading ~90 % of the blocks.
PLANT = dict(alpha=2.0, group_tokens=16, top_logit=8.0, noise=0.5)
EPS = PsaDecodeConfig.epsilon  # the kernel's default


def plant_structure(q, k, req_to_token, req_pool_indices, seq_lens, *, sm_scale, generator, alpha=PLANT["alpha"],
                    group_tokens=PLANT["group_tokens"], top_logit=PLANT["top_logit"], noise=PLANT["noise"]):
    """Overwrite the keys of every request in place with the planted power law (see ``PLANT``).

    ``q`` ``[batch, num_qo_heads, d]``, ``k`` ``[num_slots, num_kv_heads, d]``; per KV head the planted
    direction ``u`` is the minimum-norm vector with ``q_g . u = 1`` for every query head ``g`` of its
    group, so all heads of a group see the same offsets. Device-agnostic (uses ``generator``'s device).
    """
    batch, hq, d = q.shape
    hk = k.shape[1]
    grp = hq // hk
    dev = k.device
    for r in range(batch):
        L = int(seq_lens[r])
        slots = req_to_token[int(req_pool_indices[r]), :L].long()
        ng = -(-L // group_tokens)
        rank = torch.argsort(torch.rand(hk, ng, device=dev, generator=generator), dim=1).float()
        target = top_logit - alpha * torch.log1p(rank)  # [hk, ng] nats
        Q = q[r].float().view(hk, grp, d)
        A = Q @ Q.transpose(1, 2) + 1e-4 * torch.eye(grp, device=dev)
        u = (Q.transpose(1, 2) @ torch.linalg.solve(A, torch.ones(hk, grp, 1, device=dev))).squeeze(-1)  # [hk, d]
        tok = target.repeat_interleave(group_tokens, dim=1)[:, :L]  # [hk, L]
        base = torch.randn(L, hk, d, device=dev, generator=generator) * noise
        k[slots] = (base + (tok.T[:, :, None] / sm_scale) * u[None]).to(k.dtype)




def graph_of(fn):
    """CUDA graph replaying ``fn`` (as the server's decode graphs do); None on CPU."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def measure_peak_bw():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), iters=10)
    del x, y
    return 2 * (1 << 30) / t


def build_pool(batch, ctx, hq, hk, d, page, planted, seed=0, dev="cuda"):
    """KV pool with shuffled pages; optional planted structure (same pool for PSA, dense and top-k)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pages_per_req = -(-ctx // page)
    num_pages = batch * pages_per_req
    perm = torch.randperm(num_pages, device=dev, generator=g)
    req_to_token = (perm.view(batch, pages_per_req, 1) * page
                    + torch.arange(page, device=dev)).view(batch, -1)[:, :ctx].to(torch.int32).contiguous()
    k = torch.randn(num_pages * page, hk, d, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
    rpi = torch.arange(batch, dtype=torch.int32, device=dev)
    if planted:
        plant_structure(q, k, req_to_token, rpi, [ctx] * batch, sm_scale=d ** -0.5, generator=g)
    return q, k, v, req_to_token, rpi


def kept_mass(q, k, req_to_token, rpi, seq_lens_host, order, nread, page, sm_scale):
    """True kept mass per (request, qo head) and per-pair block-mass cumsum along the order."""
    batch, hq, d = q.shape
    hk = k.shape[1]
    grp = hq // hk
    kept, cums = [], []
    for r in range(batch):
        L = seq_lens_host[r]
        kk = k[req_to_token[int(rpi[r]), :L].long()].float()  # [L, hk, d]
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


def topk_at_equal_mass(cums, target_mean):
    """Smallest fixed k whose mean kept mass (over all (request, qo head)) >= target_mean."""
    nbmax = max(c.shape[1] for c in cums)
    full = torch.stack([torch.nn.functional.pad(c, (0, nbmax - c.shape[1])) for c in cums])
    for c, f in zip(cums, full):  # pad with the request's total (its last cumsum value)
        f[:, c.shape[1]:] = c[:, -1:]
    mean_k = full.mean(dim=(0, 1))  # [nbmax]
    ok = (mean_k >= target_mean - 1e-6).nonzero()
    return int(ok[0]) + 1 if ok.numel() else nbmax


def blocks_actually_read(w, nread, list_lens, n_forced):
    """Blocks the chunk kernels read: every chunk of the waves run for a pair (up to the one it stopped in); the
    selected blocks alone under schedule 'select'."""
    if w.select:
        return int(nread.sum())
    cfg = w.config
    ends = [0] + cfg.ranked_chunk_ends(w.max_blocks_per_req)
    total = 0
    nread_h, lens_h, nf_h = nread.cpu().tolist(), list_lens.cpu().tolist(), n_forced.cpu().tolist()
    for r, row in enumerate(nread_h):
        for h, n in enumerate(row):
            nf, L = min(nf_h[r], lens_h[r][h]), lens_h[r][h]
            got = n
            for c0, nc in w.waves:
                last = c0 + nc - 1
                wave_end = min(L, nf + ends[last]) if last >= 1 else nf
                if wave_end >= n:
                    got = wave_end
                    break
            total += got
    return total


def meta_vectors(cfg: PsaDecodeConfig) -> int:
    """Metadata vectors per (block, KV head) the criticality kernel loads: kmin + kmax for the cuboid score, kmean
    for the mean score or the mean rank order (:func:`flashinfer_ext.psa.criticality.block_criticality`)."""
    cuboid = cfg.criticality == "cuboid"
    mean_rank = cfg.rank_by == "mean" and (cfg.criticality, cfg.group_reduce) != ("mean", "max")
    return 2 * cuboid + int((not cuboid) or mean_rank)


def run_case(name, batch, ctx, page, planted=True, capture=None, hq=32, hk=8, d=128, eps=EPS, seed=0,
             with_topk=True, estimator="calibrated", dev="cuda", timing=True, wrapper_kw=None, cfg_kw=None,
             stage_profile=False, meta_layout=None):
    """One PSA vs dense (vs top-k) measurement; ``timing=False`` runs every kernel once and leaves the
    times NaN (CPU runs of captured cases: the interpreter's timings mean nothing and cost minutes).
    ``wrapper_kw``: extra :class:`PsaDecodeWrapper` arguments (the wave plan: ``wave_programs``,
    ``wave_growth``, ``max_waves``), recorded in the row; ``cfg_kw``: :class:`PsaDecodeConfig` overrides
    (``sorted_prefix_blocks``); ``meta_layout``: the :class:`BlockMetaPool` layout (default the wrapper's
    ``META_LAYOUT``; ``wrapper_kw`` may carry ``crit_tile``); ``stage_profile``: also time the stages apart (``t_stage_us``: criticality, ranking,
    bound suffix, waves + merges; CUDA only): CUDA graphs of the run cut after each stage, differences of their
    replay times."""
    if dev == "cuda":
        torch.cuda.empty_cache()
    if capture is not None:
        q, k, v, req_to_token, rpi, seq_host = capture
        batch, hq, d = q.shape
        hk = k.shape[1]
    else:
        q, k, v, req_to_token, rpi = build_pool(batch, ctx, hq, hk, d, page, planted, seed, dev=dev)
        seq_host = [ctx] * batch
    seq_lens = torch.tensor(seq_host, dtype=torch.int32, device=dev)
    sm_scale = d ** -0.5
    nb = -(-max(seq_host) // page)
    table = paged_block_table(req_to_token, rpi, page, nb)
    num_rows = k.shape[0] // page + 1
    meta_layout = meta_layout or PsaDecodeWrapper.META_LAYOUT
    # an int4 copy of every key in place of the block min / max / mean; 'select' = the sketch with schedule 'select'
    sketch = estimator in ("sketch", "select")
    if sketch:
        meta = KeySketchPool(1, num_rows, hk, d, page, device=dev)
        cfg_kw = dict(cfg_kw or {}, criticality="sketch", schedule="select" if estimator == "select" else "progressive")
    else:
        meta = BlockMetaPool(1, num_rows, hk, d, page, dtype=torch.bfloat16, device=dev, layout=meta_layout)
    if capture is None:
        meta.update(0, k, req_to_token, rpi, table, torch.zeros_like(seq_lens), seq_lens, nb)
    else:  # requests of one layer share pages: write shorter ones first so the full pages win (a superset
        # of a shorter request's partial page still bounds its keys)
        for r in sorted(range(batch), key=lambda i: seq_host[i]):
            meta.update(0, k, req_to_token, rpi[r:r + 1], table[r:r + 1], torch.zeros_like(seq_lens[r:r + 1]),
                        seq_lens[r:r + 1], nb)
    cfg = PsaDecodeConfig(epsilon=min(eps, 1.0), micro_batch_blocks=8, sink_blocks=1, local_blocks=2,
                          max_blocks=1 << 20, estimator="sketch" if sketch else estimator, **(cfg_kw or {}))
    w = PsaDecodeWrapper(cfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=page,
                         max_batch_size=batch, max_blocks_per_req=nb, device=dev, sm_scale=sm_scale,
                         **(wrapper_kw or {}))
    w.plan(req_to_token, rpi, seq_lens, table)
    ml = meta.layer(0)
    nan = float("nan")
    t_eager = timed(lambda: w.run(q, k, v, *ml), iters=5, warmup=1) if timing else nan
    g = graph_of(lambda: w.run(q, k, v, *ml)) if timing else None
    t_psa = timed(g.replay) if g is not None else t_eager
    o, lse, nread = w.run(q, k, v, *ml)
    kept_est = w.kept_est.clone()
    if dev == "cuda":
        torch.cuda.synchronize()
    try:
        dense = FlashInferDenseDecode(hq, hk, d, page, device=dev)
        dense.plan(*paged_kv_table(req_to_token, rpi.tolist(), seq_host, page), sm_scale=sm_scale)
        t_dense = timed(lambda: dense.run(q, k, v)) if timing else nan
        do, _ = dense.run(q, k, v)
    except ImportError:  # no flashinfer: PSA numbers only, dense columns NaN
        dense, t_dense, do = None, float("nan"), torch.full_like(o, float("nan"))
    blk_bytes = page * d * 2 * 2  # K + V, bf16, one KV head
    total_blocks = sum(-(-L // page) for L in seq_host) * hk
    blocks_read = int(nread.sum())
    actual = blocks_actually_read(w, nread, w._list_lens_buf[:batch], w._n_forced_buf[:batch])
    if sketch:  # every token's int4 key and fp16 scale, per KV head
        meta_bytes = sum(seq_host) * hk * (d // 2 + 2)
    else:  # the block metadata the criticality pass reads, bf16
        meta_bytes = total_blocks * meta_vectors(cfg) * d * 2
    psa_bytes = actual * blk_bytes + meta_bytes
    dense_bytes = sum(seq_host) * hk * d * 2 * 2
    kept, cums = kept_mass(q, k, req_to_token, rpi, seq_host, w.order, nread, page, sm_scale)
    res = dict(case=name, estimator=estimator, batch=batch, ctx=max(seq_host), page=page, heads=f"{hq}/{hk}",
               head_dim=d, eps=eps, planted=planted, waves=len(w.waves), t_psa_us=t_psa * 1e6,
               t_psa_eager_us=t_eager * 1e6, t_dense_us=t_dense * 1e6, speedup=t_dense / t_psa,
               blocks_read=blocks_read, blocks_read_by_kernels=actual, blocks_total=total_blocks,
               read_frac=blocks_read / total_blocks, kernel_read_frac=actual / total_blocks,
               psa_bytes=psa_bytes, dense_bytes=dense_bytes, psa_tbps=psa_bytes / t_psa / 1e12,
               dense_tbps=dense_bytes / t_dense / 1e12, kept_mean=float(kept.mean()), kept_min=float(kept.min()),
               kept_ge_eps=float((kept >= eps).float().mean()), kept_est_mean=float(kept_est.mean()),
               max_abs_err_vs_dense=float((o.float() - do.float()).abs().max()),
               wave_programs=w.wave_programs, wave_growth=w.wave_growth, max_waves=w.max_waves,
               sorted_prefix_blocks=cfg.sorted_prefix_blocks, meta_layout=meta_layout,
               crit_tile=dataclasses.asdict(w.crit_tile))
    if stage_profile and g is not None:
        cum = {}
        for st in PsaDecodeWrapper.STAGES:
            gs = graph_of(lambda st=st: w.run(q, k, v, *ml, stop_after=st))
            cum[st] = timed(gs.replay)
            del gs
        res["t_stage_us"] = {"criticality": cum["criticality"] * 1e6,
                             "ranking": (cum["ranking"] - cum["criticality"]) * 1e6,
                             "bound_suffix": (cum["suffix"] - cum["ranking"]) * 1e6,
                             "waves_and_merges": (t_psa - cum["suffix"]) * 1e6}
        res["criticality_bytes"] = meta_bytes
        res["criticality_tbps"] = meta_bytes / cum["criticality"] / 1e12
    if with_topk and eps < 1.0:
        kq = topk_at_equal_mass(cums, res["kept_mean"])
        n_forced = min(nb, 3)
        # top-k = the same wave kernels with the list capped at k; 'bound' with eps ~ 1 never stops earlier
        tkw = dict(estimator="sketch", criticality="sketch") if sketch else dict(estimator="bound")
        tcfg = PsaDecodeConfig(epsilon=1.0 - 1e-6, micro_batch_blocks=8, sink_blocks=1, local_blocks=2,
                               max_blocks=max(1, kq - n_forced), **tkw)
        wt = PsaDecodeWrapper(tcfg, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, block_size=page,
                              max_batch_size=batch, max_blocks_per_req=nb, device=dev, sm_scale=sm_scale)
        wt.plan(req_to_token, rpi, seq_lens, table)
        gt = graph_of(lambda: wt.run(q, k, v, *ml)) if timing else None
        t_q = timed(gt.replay if gt is not None else (lambda: wt.run(q, k, v, *ml))) if timing else nan
        topk_blocks = sum(min(-(-L // page), kq) for L in seq_host) * hk
        res.update(topk_k=kq, topk_blocks=topk_blocks,
                   topk_over_psa_bytes=(topk_blocks * blk_bytes + meta_bytes) / psa_bytes,
                   topk_over_psa_bytes_result=(topk_blocks * blk_bytes + meta_bytes)
                   / (blocks_read * blk_bytes + meta_bytes), t_topk_us=t_q * 1e6)
        del wt, gt
    if eps >= 1.0 and dense is not None:
        # The server's short-context path (sglang_sparse.psa.runner): below min_context a decode batch is
        # the stock FlashInfer decode alone (block metadata is kept only for contexts >= min_context), so
        # its time is a second, independent timing of the dense call; the metadata upkeep a long row adds
        # per layer is reported beside it for reference.
        t_server = timed(lambda: dense.run(q, k, v))
        gm = graph_of(lambda: w.update_meta_decode(k, *ml))
        t_meta = timed(gm.replay if gm is not None else (lambda: w.update_meta_decode(k, *ml)))
        res.update(t_meta_update_us=t_meta * 1e6, t_server_short_us=t_server * 1e6,
                   dense_over_server_short=t_dense / t_server)
    del meta, w, dense, k, v, g
    return res


def capture_smollm(num_tokens, layers, positions, dev="cuda"):
    """The 8k model's real-text capture as the bench's pool tuple (:func:`bench.real_capture.decode_pool`)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from psa_capture import capture_qkv  # noqa: E402

    cap = capture_qkv(num_tokens=num_tokens, layers=layers, device=dev)
    return real_capture.decode_pool(cap, tuple(layers), positions, dev)


REAL_SLOTS = {"real_16k": 16000, "real_32k": 32000}  # prompt tokens of the testbed captures
REAL_LAYERS = (3, 9, 15, 21, 27)


def run_real(model_dir, slot_tokens: dict, layers, dev: str, wrapper_kw=None, cfg_kw=None,
             estimators=(PsaDecodeConfig.estimator,)) -> list:
    """The ``testbed real`` rows: per slot one capture of the 32k testbed model on its needle prompt
    (:mod:`bench.real_capture`), decode requests at 3 positions near the end of the prompt
    (:func:`~bench.real_capture.decode_positions`) x ``layers`` (9/3 heads, d=64, page 16, bf16 pool),
    through :func:`run_case` with each of ``estimators`` (default: the kernel's default). Timed on CUDA only."""
    rows = []
    try:
        caps = real_capture.testbed_captures(model_dir, slot_tokens, tuple(layers), dev)
        for slot, cap, info in caps:
            try:
                pos = real_capture.decode_positions(info["prompt_len"])
                pool = real_capture.decode_pool(cap, tuple(layers), pos, dev)
                del cap
                for est in estimators:
                    try:
                        r = run_case(real_capture.REAL_CASE, 0, 0, 16, planted=False, capture=pool, estimator=est,
                                     dev=dev, timing=dev == "cuda", wrapper_kw=wrapper_kw, cfg_kw=cfg_kw)
                        r.update(slot=slot, positions=pos, **info)
                        print(json.dumps(r), flush=True)
                    except Exception as e:
                        traceback.print_exc()
                        r = dict(case=real_capture.REAL_CASE, slot=slot, page=16, estimator=est, **info,
                                 error=f"{type(e).__name__}: {e}")
                    rows.append(r)
            except Exception as e:
                traceback.print_exc()
                rows.append(dict(case=real_capture.REAL_CASE, slot=slot, page=16, **info,
                                 error=f"{type(e).__name__}: {e}"))
            if dev == "cuda":
                torch.cuda.empty_cache()
    except Exception as e:  # model load / capture failed: every slot not done yet records it
        traceback.print_exc()
        done = {r["slot"] for r in rows}
        rows += [dict(case=real_capture.REAL_CASE, slot=s, page=16, model=str(model_dir),
                      error=f"{type(e).__name__}: {e}") for s in slot_tokens if s not in done]
    return rows


def real_summary(results: list, gpu: str, estimators=(PsaDecodeConfig.estimator,)) -> dict:
    """``{"real_16k": {...}, "real_32k": {...}}`` from the ``testbed real`` rows of the kernel's default estimator
    (the other ``estimators`` under ``real_16k_<estimator>``...): read fraction (blocks in the result / all
    blocks), FlashInfer dense time / PSA time (CUDA-graph replay; null without a GPU timing), top-k bytes / PSA bytes at equal mean kept mass; plus
    context, kept mass and the device."""
    out = {}
    for slot, est in ((s, e) for e in estimators for s in REAL_SLOTS):
        key = slot if est == PsaDecodeConfig.estimator else f"{slot}_{est}"
        r = next((r for r in results if r.get("case") == real_capture.REAL_CASE and r.get("slot") == slot
                  and r.get("estimator", est) == est), None)
        if r is None:
            continue
        f = real_capture.finite
        if "error" in r:
            out[key] = dict(read_fraction=None, speedup_vs_dense=None, bytes_ratio_topk_over_psa=None,
                            error=r["error"], gpu=gpu)
            continue
        out[key] = dict(read_fraction=f(r["read_frac"]), speedup_vs_dense=f(r["speedup"]),
                        bytes_ratio_topk_over_psa=f(r.get("topk_over_psa_bytes")),
                        kernel_read_fraction=f(r["kernel_read_frac"]), kept_mean=f(r["kept_mean"]),
                        kept_est_mean=f(r["kept_est_mean"]), topk_k=r.get("topk_k"), ctx=r["ctx"],
                        prompt_len=r.get("prompt_len"), requests=r["batch"], layers=r.get("layers"),
                        estimator=r["estimator"], eps=r["eps"], gpu=gpu)
    return out


def summary(meta: dict, results: list) -> dict:
    def find(**kw):
        for r in results:
            if "error" not in r and all(r.get(a) == b for a, b in kw.items()):
                return r
        return None

    def num(x):
        return None if x is None or not math.isfinite(x) else float(x)

    main = find(case="planted", batch=8, ctx=131072, page=16, estimator="calibrated")
    smol = find(case="smollm2 real text", estimator="calibrated")
    short = find(case="server short path (4k)", batch=8) or find(case="server short path (4k)")
    return {"gpu": meta["gpu"],
            "speedup_128k_b8_eps095": num(main["speedup"]) if main else None,
            "fraction_of_bytes_limit": num(main["psa_tbps"] * 1e12 / meta["peak_bps"])
            if main and meta.get("peak_bps") else None,
            "bytes_ratio_topk_over_psa": num(smol.get("topk_over_psa_bytes")) if smol else None,
            "dense_over_psa_time_4k": num(short.get("dense_over_server_short")) if short else None,
            **real_summary(results, meta["gpu"])}


def write_report(out: Path, meta: dict, results: list, top: dict | None = None):
    """Write ``psa_decode.{json,md,png}``; ``top`` (a merged ``--real-only`` run) replaces the summary."""
    out.mkdir(parents=True, exist_ok=True)
    top = summary(meta, results) if top is None else top
    (out / "psa_decode.json").write_text(json.dumps(dict(**top, meta=meta, results=results), indent=1))
    lines = ["# PSA progressive decode vs FlashInfer dense decode", "",
             f"- command: `{meta['command']}`", f"- device: {meta['gpu']}; peak copy bandwidth "
             f"{meta.get('peak_bps', float('nan')) / 1e12:.2f} TB/s (1 GiB device copy, read+write)",
             f"- versions: {meta['versions']}", f"- planted structure: {meta['plant']} (see PLANT in the script)",
             f"- PSA: eps={EPS}, micro-batch 8 blocks (chunks grow past 128 ranks, <= 1/16 overshoot), sink 1, "
             "local 2 blocks, cuboid bound (group max) for the stop test, blocks ranked by q . mean key, metadata bf16; t PSA = median of 20 CUDA-graph "
             "replays of one layer (eager in its own column)",
             "- bytes: PSA = K+V of the blocks the kernels read (incl. last-wave over-read) + the metadata the "
             "criticality pass reads for every block (kmin, kmax and, ranking by the mean key, kmean); dense = all "
             "K+V; top-k at equal mean kept mass (same ranking, same wave kernels)",
             "- testbed real rows: q/k/v captured from the 32k testbed model (YaRN) on its needle prompt "
             "(bench/real_capture.py), decode at 3 positions near the prompt's end x layers "
             f"{(meta.get('real_run') or meta).get('real_layers')}"
             + (f"; measured by `{meta['real_run']['command']}` on {meta['real_run']['gpu']}"
                if meta.get("real_run") else ""), "",
             "## Summary", "", "```", json.dumps(top, indent=1), "```", "",
             "| case | est | batch | ctx | page | heads | waves | t PSA us | t eager us | t dense us | dense/PSA |"
             " result frac | kernel frac | kept mean | kept min | kept>=eps | PSA TB/s | dense TB/s | top-k k |"
             " top-k/PSA bytes | t top-k us | err vs dense |",
             "|" + "---|" * 22]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | FAILED: {r['error'][:160]} |" + " |" * 20)
            continue
        lines.append(
            f"| {r['case']} | {r['estimator']} | {r['batch']} | {r['ctx']} | {r['page']} | {r['heads']} | "
            f"{r['waves']} | {r['t_psa_us']:.1f} | {r['t_psa_eager_us']:.1f} | {r['t_dense_us']:.1f} | "
            f"{r['speedup']:.2f} | {r['read_frac']:.4f} | {r['kernel_read_frac']:.4f} | {r['kept_mean']:.4f} | "
            f"{r['kept_min']:.4f} | {r['kept_ge_eps']:.3f} | {r['psa_tbps']:.2f} | {r['dense_tbps']:.2f} | "
            f"{r.get('topk_k', '-')} | {r.get('topk_over_psa_bytes', float('nan')):.2f} | "
            f"{r.get('t_topk_us', float('nan')):.1f} | {r['max_abs_err_vs_dense']:.3g} |")
    short = [r for r in results if "t_server_short_us" in r]
    if short:
        lines += ["", "Server short-context path (below min_context the server runs the stock FlashInfer decode alone; second timing of it; the per-layer metadata fold a long row adds is shown for reference):", ""]
        for r in short:
            lines.append(f"- batch {r['batch']}, ctx {r['ctx']}: dense {r['t_dense_us']:.1f} us, server short path "
                         f"{r['t_server_short_us']:.1f} us -> dense / server path = {r['dense_over_server_short']:.3f} "
                         f"(metadata fold a long row adds: {r['t_meta_update_us']:.1f} us per layer)")
    (out / "psa_decode.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for b in sorted({r["batch"] for r in results if r.get("case") == "planted" and "error" not in r}):
            pts = sorted((r["ctx"], r["speedup"]) for r in results
                         if r.get("case") == "planted" and r["batch"] == b and r["page"] == 16 and "error" not in r
                         and r["estimator"] == "calibrated" and math.isfinite(r["speedup"]))
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
        plt.close(fig)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="a subset of cases (~1.5 minutes)")
    ap.add_argument("--smoke", action="store_true", help="two tiny cases on the CPU (Triton interpreter)")
    ap.add_argument("--no-smollm", action="store_true")
    ap.add_argument("--real-only", action="store_true",
                    help="only the testbed real cases (real_16k, real_32k), merged into an existing psa_decode.json "
                         "in --out (its rows and summary keys kept; the real ones replaced); runs on a CPU too")
    ap.add_argument("--no-real", action="store_true", help="skip the testbed real cases in a full run")
    ap.add_argument("--testbed-model", type=Path, default=real_capture.TESTBED_MODEL,
                    help="the 32k testbed model folder (default: the repo's models/SmolLM2-135M-Instruct-32k)")
    ap.add_argument("--real-tokens", default=None,
                    help="prompt tokens of real_16k,real_32k (default 16000,32000; e.g. 1024,2048 on a CPU)")
    ap.add_argument("--real-layers", default=",".join(map(str, REAL_LAYERS)), help="captured layers")
    ap.add_argument("--real-estimators", default=PsaDecodeConfig.estimator,
                    help="stop-test estimators of the testbed real rows, comma-separated (the kernel's default gives "
                         "real_16k / real_32k, the others real_16k_<estimator>...; e.g. select,sketch,calibrated, "
                         "where select = the sketch with schedule 'select')")
    ap.add_argument("--wave-plan", default=None, metavar="PROGRAMS_PER_SM,GROWTH,MAX_WAVES[,SORTED_PREFIX]",
                    help="the wrapper's wave plan for every case (default: PsaDecodeWrapper's); 'best:SWEEP.json' takes "
                         "the plan pick_wave_plan chooses from a --wave-sweep report")
    ap.add_argument("--stage-profile", action="store_true",
                    help="only the stage times (criticality, ranking, bound suffix, waves + merges) of the headline "
                         "planted cases and the 32k testbed capture: psa_stage_profile.{json,md} in --out")
    ap.add_argument("--stage-estimator", default=None,
                    help="with --stage-profile: only the testbed capture, with this stop-test estimator (e.g. sketch); "
                         "writes psa_stage_profile_<estimator>.{json,md}")
    ap.add_argument("--crit-sweep", action="store_true",
                    help="only the criticality pass's launch shapes x metadata layouts (psa_plans.CRIT_SWEEP_GRID) over "
                         "the headline planted cases and the 32k testbed capture: psa_crit_sweep.{json,md} in --out")
    ap.add_argument("--wave-sweep", action="store_true",
                    help="only the planted cases over wave plans (first-wave programs, growth, max waves): "
                         "psa_wave_sweep.{json,md} in --out (with --smoke: a tiny case on the CPU)")
    args = ap.parse_args()
    wkw, ckw = psa_plans.wave_plan_arg(args.wave_plan)
    slot_tokens = real_capture.parse_tokens(args.real_tokens, REAL_SLOTS)
    real_layers = tuple(int(x) for x in args.real_layers.split(","))
    t0 = time.time()
    import triton

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
        print("flashinfer is not installed: dense baseline columns will be NaN")
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    meta = dict(command=" ".join([sys.executable.split("/")[-1]] + sys.argv),
                gpu=torch.cuda.get_device_name() if dev == "cuda" else f"CPU ({platform.processor() or 'cpu'}, "
                "Triton interpreter: timings meaningless)",
                versions=f"torch {torch.__version__}, triton {triton.__version__}, flashinfer "
                         f"{getattr(flashinfer, '__version__', '?')}, python {platform.python_version()}",
                plant=PLANT, shapes="Llama-3.1-8B attention: 32 qo / 8 kv heads, head_dim 128, bf16")
    if wkw:
        meta["wave_plan"] = dict(wkw, **ckw)
    meta.update(real_tokens=slot_tokens, real_layers=list(real_layers), testbed_model=str(args.testbed_model))
    results = []
    meta["peak_bps"] = float("nan")
    if dev == "cuda":
        try:
            meta["peak_bps"] = measure_peak_bw()
        except Exception as e:
            print("peak measurement failed:", e)
    if args.stage_profile:
        real_pool = psa_plans.real_pool(args.testbed_model, slot_tokens, real_layers, dev, meta)
        cases = ((2, 300, 16),) if args.smoke else psa_plans.WAVE_SWEEP_CASES
        psa_plans.run_stage_profile(run_case, args.out, meta, dev, cases=() if args.stage_estimator else cases,
                                    real_pool=real_pool, estimator=args.stage_estimator)
        return
    if args.crit_sweep:
        real_pool = psa_plans.real_pool(args.testbed_model, slot_tokens, real_layers, dev, meta)
        psa_plans.run_crit_sweep(run_case, args.out, meta, dev, real_pool=real_pool,
                                 cases=((2, 300, 16),) if args.smoke else psa_plans.WAVE_SWEEP_CASES)
        return
    if args.wave_sweep:
        real_pool = psa_plans.real_pool(args.testbed_model, slot_tokens, real_layers, dev, meta)
        if args.smoke:
            grid = [dict(wave_programs=4, wave_growth=2.0, max_waves=12, sorted_prefix_blocks=1024),
                    dict(wave_programs=2, wave_growth=8.0, max_waves=5, sorted_prefix_blocks=256)]
            psa_plans.run_wave_sweep(run_case, args.out, meta, dev, cases=((2, 300, 16),), real_pool=real_pool,
                                     grid=grid)
        else:
            psa_plans.run_wave_sweep(run_case, args.out, meta, dev, real_pool=real_pool)
        return
    if args.real_only:
        ests = tuple(x for x in args.real_estimators.split(",") if x)
        rows = run_real(args.testbed_model, slot_tokens, real_layers, dev, wrapper_kw=wkw, cfg_kw=ckw, estimators=ests)
        real_capture.finish_real_only(args.out / "psa_decode.json", rows, real_summary(rows, meta["gpu"], ests), meta,
                                      write_report, t0)
        return
    if args.smoke:
        cases = [("planted", dict(batch=2, ctx=300, page=16, hq=8, hk=2, d=64)),
                 ("server short path (4k)", dict(batch=1, ctx=100, page=16, hq=4, hk=1, d=64, eps=1.0,
                                                 with_topk=False))]
    else:
        if args.quick:
            grid = [(8, 131072, 16), (1, 32768, 16), (8, 32768, 16), (32, 8192, 16), (8, 32768, 64)]
            short = [8]
        else:
            grid = [(b, c, p) for p in (16, 32, 64) for b in (1, 8, 32) for c in (8192, 32768, 131072)]
            grid.sort(key=lambda x: (x != (8, 131072, 16),))  # the headline case first
            short = [1, 8, 32]
        cases = [("planted", dict(batch=b, ctx=c, page=p)) for b, c, p in grid]
        cases.insert(1, ("planted", dict(batch=8, ctx=131072, page=16, estimator="paper")))
        cases += [("server short path (4k)", dict(batch=b, ctx=4096, page=16, eps=1.0, with_topk=False))
                  for b in short]
        cases += [("random keys (4k)", dict(batch=8, ctx=4096, page=16, planted=False))]
    for name, kw in cases:
        try:
            r = run_case(name, dev=dev, wrapper_kw=wkw, cfg_kw=ckw, **kw)
            print(json.dumps(r), flush=True)
            results.append(r)
        except Exception as e:
            traceback.print_exc()
            results.append(dict(case=name, **kw, error=f"{type(e).__name__}: {e}"))
        write_report(args.out, meta, results)
    if not args.no_smollm and not args.smoke:
        cap = None
        for est in ("calibrated", "paper"):
            try:
                cap = cap or capture_smollm(8192, (3, 9, 15, 21, 27), (4095, 6000, 8191), dev=dev)
                r = run_case("smollm2 real text", 0, 0, 16, capture=cap, estimator=est, dev=dev, wrapper_kw=wkw,
                             cfg_kw=ckw)
                print(json.dumps(r), flush=True)
                results.append(r)
            except Exception as e:
                traceback.print_exc()
                results.append(dict(case="smollm2 real text", estimator=est, page=16, error=f"{type(e).__name__}: {e}"))
    if not args.no_real and not args.smoke:
        write_report(args.out, meta, results)
        if (args.testbed_model / "config.json").is_file():
            results += run_real(args.testbed_model, slot_tokens, real_layers, dev, wrapper_kw=wkw, cfg_kw=ckw)
        else:  # a device without the testbed folder: no error rows that would hide an earlier --real-only run
            meta["real_skipped"] = f"no testbed model at {args.testbed_model} (--testbed-model)"
            print(meta["real_skipped"])
    meta["wall_s"] = time.time() - t0
    write_report(args.out, meta, results)
    print(json.dumps(summary(meta, results)))
    print(f"wrote {args.out}/psa_decode.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
