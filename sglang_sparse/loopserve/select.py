"""LoopServe Alg. 3's batched top-B re-selection of a decode step (and lastwindow's one selection), for
:class:`sglang_sparse.loopserve.runner.LoopServeRunner`: the host planning of the step's observation queries
(:func:`plan_selection`, once per step) and the per-layer estimation + top-B (:func:`reselect`, device work only).

Both take the runner (its ``cfg``, ``shape``, ``device``, ``use_kernels``, ``lastwindow``) and the step's decode
dict planned by ``LoopServeRunner.begin_batch``.
"""

from __future__ import annotations

import torch

from flashinfer_ext.loopserve.vs_estimate import launch_meta
from flashinfer_ext.loopserve.vs_estimate_batched import decode_topb_masks, lse_splits

__all__ = ["plan_selection", "reselect", "snapkv_pool", "h2d"]


def h2d(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without blocking the host: staged through pinned memory (the caching host
    allocator keeps the pinned block until the copy has run), a non-blocking copy on the current stream."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def plan_selection(runner, states, lens, fire, rpi) -> dict | None:
    """Alg. 3's batched re-selection inputs of this decode step (host work, once per step).

    For the re-selecting rows (``F`` of them, in row order): their observation queries' earlier
    positions copied from the rings for all layers at once into ``obs_buf [L, R_total, Hq, D]`` (the
    current query's row is filled per layer), the rows' positions ``obs_pos [R_total]``, request index
    ``q_req`` / ``qo_indptr``, where the current queries go (``cur_rows``, from batch rows ``fire_dev``),
    the scored length per row (``sel_seq``: the context, lastwindow: the prompt), the budgets and the
    top-B width (``max_b min(budget, sel_seq)``); all index tensors in one host->device copy; the
    kernels' ``vsum_buf [F, Hk, max sel_seq]`` and ``lse_buf [Hq, R_total]`` fp32, reused by every layer.
    """
    cfg, dev = runner.cfg, runner.device
    fire_j = [j for j, f in enumerate(fire) if f]
    if not fire_j:
        return None
    st0 = states[fire_j[0]]
    spans = []  # (first observed position, ring rows, scored length) per re-selecting row
    for j in fire_j:
        st = states[j]
        if runner.lastwindow:  # the prompt's last `window` queries, recorded at prefill; keys up to the prompt
            spans.append((st.ring_lo, st.prompt_len - st.ring_lo, st.prompt_len))
        else:  # the last n_d queries: the ring holds the positions before this one
            pos = lens[j] - 1
            lo = max(st.ring_lo, pos - cfg.n_d + 1)
            spans.append((lo, pos - lo, pos + 1))
    n_cur = 0 if runner.lastwindow else 1
    counts = [n + n_cur for _, n, _ in spans]
    r_total = sum(counts)
    obs_buf = torch.empty(st0.ring.shape[0], r_total, st0.ring.shape[2], st0.ring.shape[3],
                          dtype=st0.ring.dtype, device=dev)
    obs_pos, q_req, cur_rows, indptr = [], [], [], [0]
    for f, (j, (lo, n_ring, _)) in enumerate(zip(fire_j, spans)):
        r0 = indptr[-1]
        ring = states[j].ring  # positions lo.. sit at ring slots lo % R.. (at most one wrap: two slices)
        s0 = lo % ring.shape[1]
        first = min(n_ring, ring.shape[1] - s0)
        if first > 0:
            obs_buf[:, r0: r0 + first] = ring[:, s0: s0 + first]
        if n_ring > first:
            obs_buf[:, r0 + first: r0 + n_ring] = ring[:, : n_ring - first]
        cur_rows += [r0 + n_ring] * n_cur
        obs_pos += range(lo, lo + counts[f])
        q_req += [f] * counts[f]
        indptr.append(r0 + counts[f])
    budgets = [states[j].budget for j in fire_j]
    sel_seq = [hi for _, _, hi in spans]
    # the candidates of top-B: lastwindow (SnapKV) chooses from the positions before its observation
    # window (the window, the sink and the generated tokens are attended anyway); loopserve from all
    cand = [max(lo, 1) for lo, _, _ in spans] if runner.lastwindow else sel_seq
    parts = [obs_pos, q_req, indptr, cur_rows, fire_j, sel_seq, budgets, cand]
    packed = h2d(torch.tensor([x for part in parts for x in part], dtype=torch.int64), dev)
    views = packed.split([len(part) for part in parts])
    widths = [min(b, n) for b, n in zip(budgets, cand)]
    # top-B's masks are the same at every layer of the step: built once here
    excluded, valid = decode_topb_masks(views[6], views[7], max(sel_seq), max(widths))
    kw = dict(dtype=torch.float32, device=dev)
    vsum_buf, lse_buf = (torch.empty(len(fire_j), runner.shape.num_kv_heads, max(sel_seq), **kw),
                         torch.empty(runner.shape.num_qo_heads, r_total, **kw)) if runner.use_kernels else (None, None)
    # long contexts, few rows: the LSE pass walks the keys in spans on separate programs (host ints only)
    num_splits = lse_splits(len(fire_j), runner.shape.num_kv_heads, _row_blocks(runner.shape, max(counts)),
                            max(sel_seq), runner.target_programs, runner.lse_min_split_keys) if runner.use_kernels else 1
    lse_part_buf = torch.empty(2, num_splits, runner.shape.num_qo_heads, r_total, **kw) if num_splits > 1 else None
    return dict(obs_buf=obs_buf, vsum_buf=vsum_buf, lse_buf=lse_buf, num_splits=num_splits, lse_part_buf=lse_part_buf,
                obs_pos=views[0], q_req=views[1],
                qo_indptr=views[2], cur_rows=views[3], fire_dev=views[4], sel_seq=views[5], budgets=views[6],
                cand_seq=views[7],
                excluded=excluded, valid=valid, max_len=max(sel_seq), width=max(widths), max_qo_len=max(counts), rpi=rpi[views[4].to(rpi.device)],
                widths=list(zip(fire_j, widths)))


def _row_blocks(shape, rows: int) -> int:
    """Row blocks of :func:`~flashinfer_ext.loopserve.vs_estimate_batched.vertical_sums_batched`'s LSE grid for ``rows``
    observation rows of one request (its default ``block_r``)."""
    group = shape.num_qo_heads // shape.num_kv_heads
    return -(-rows // launch_meta(group, shape.head_dim, 16, 64)["BLOCK_R"])


def reselect(runner, d, sel, q_s, k_buf, rtt, lid, scale) -> None:
    """Alg. 3 / Eq. 7 for all re-selecting rows of this step, one layer: their observation queries
    (earlier ones planned in ``obs_buf``, this step's from ``q_s [nS, Hq, D]``), one batched vertical-sum
    estimation, one top-B, one scatter into the step's ``topb [nS, L, Hk, W]``."""
    from flashinfer_ext.loopserve.vs_estimate_batched import (decode_topb_masked, vertical_sums_batched,
                                                    vertical_sums_batched_reference)

    q_obs = sel["obs_buf"][lid]
    if not runner.lastwindow:
        q_obs.index_copy_(0, sel["cur_rows"], q_s.index_select(0, sel["fire_dev"]).to(q_obs.dtype))
    args = (q_obs, sel["obs_pos"], sel["q_req"], k_buf, rtt, sel["rpi"], sel["sel_seq"], sel["max_len"])
    if runner.use_kernels:
        v_sum = vertical_sums_batched(*args, sm_scale=scale, out=sel["vsum_buf"], lse_buf=sel["lse_buf"],
                                      qo_indptr=sel["qo_indptr"], max_qo_len=sel["max_qo_len"],
                                      num_splits=sel["num_splits"], lse_part_buf=sel["lse_part_buf"],
                                      target_programs=runner.target_programs)
    else:
        v_sum = vertical_sums_batched_reference(*args, sm_scale=scale)
    if runner.lastwindow:  # SnapKV: pool the scores over neighbouring positions, never pick the sink
        v_sum = snapkv_pool(v_sum, runner.cfg.pool_kernel, runner.cfg.sink_tokens)
    lists = decode_topb_masked(v_sum, sel["excluded"], sel["valid"])
    d["topb"][sel["fire_dev"], lid, :, : sel["width"]] = lists


def snapkv_pool(v_sum: torch.Tensor, kernel: int, sink_tokens: int) -> torch.Tensor:
    """SnapKV's clustering of ``v_sum [F, Hk, N]`` fp32: average over ``kernel`` neighbouring positions
    (stride 1, same length; a kept token brings its neighbours' evidence, so a multi-token fact such as
    a 4-digit number is kept whole), then the first ``sink_tokens`` positions (always attended) set to
    ``-1`` (below every real score, above the ``-inf`` that :func:`decode_topb_batched` gives positions
    past the candidates, so a budget larger than the candidates never picks such a position).
    Allocates (lastwindow selects once per request, at its first decode step)."""
    import torch.nn.functional as F

    out = F.avg_pool1d(v_sum, kernel, stride=1, padding=kernel // 2, count_include_pad=False) if kernel > 1 \
        else v_sum.clone()
    out[:, :, :sink_tokens] = -1.0
    return out
