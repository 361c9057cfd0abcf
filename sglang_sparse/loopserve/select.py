"""LoopServe Alg. 3's batched top-B re-selection of a decode step (and lastwindow's one selection), for
:class:`sglang_sparse.loopserve.runner.LoopServeRunner`: the host planning of the step's observation queries
(:func:`plan_selection`, once per step) and the per-layer estimation + top-B (:func:`reselect`, device work only).

Both take the runner (its ``cfg``, ``shape``, ``device``, ``use_kernels``, ``lastwindow``) and the step's decode
dict planned by ``LoopServeRunner.begin_batch``.
"""

from __future__ import annotations

import torch

from flashinfer_ext.loopserve.vs_estimate_batched import decode_topb_masks

__all__ = ["plan_selection", "selection_buffers", "reselect", "snapkv_pool", "h2d", "SELECT_SPLIT_KEYS"]


def h2d(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without blocking the host: staged through pinned memory (the caching host
    allocator keeps the pinned block until the copy has run), a non-blocking copy on the current stream."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def plan_selection(runner, states, lens, fire, rpi, into: dict | None = None) -> dict | None:
    """Alg. 3's batched re-selection inputs of this decode step (host work, once per step).

    For the re-selecting rows (``F`` of them, in row order): their observation queries' earlier
    positions copied from the rings for all layers at once into ``obs_buf [L, R_total, Hq, D]`` (the
    current query's row is filled per layer), the rows' positions ``obs_pos [R_total]``, request index
    ``q_req`` / ``qo_indptr``, where the current queries go (``cur_rows``, taken from batch rows ``fire_q``; the
    new top-B is written to rows ``fire_dev`` of ``d["topb_rows"]``), the scored length per row (``sel_seq``: the
    context, lastwindow: the prompt), the budgets and the top-B width (``max_b min(budget, sel_seq)``); all index
    tensors in one host->device copy; the kernels' ``vsum_buf [F, Hk, max sel_seq]`` and ``lse_buf [Hq, R_total]``
    fp32, reused by every layer. The LSE pass walks the keys in spans of ``runner.lse_split_keys`` (default
    ``SELECT_SPLIT_KEYS``; the same bits at any padded width).

    ``into``: the static selection of a captured decode graph (:func:`selection_buffers`): the same inputs are
    written into its fixed buffers, padded to its ``f_cap`` request slots (padding slots: no rows, length 0,
    their top-B into a trash row), and its dict is returned with this step's ``widths``. Every re-selecting row
    must then observe exactly ``n_d`` queries, with a budget <= its top-B width and a context <= its key width
    (:meth:`sglang_sparse.loopserve.graph.LoopServeGraphs.wants_select`).
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
    obs_buf = into["obs_buf"] if into is not None else torch.empty(
        st0.ring.shape[0], r_total, st0.ring.shape[2], st0.ring.shape[3], dtype=st0.ring.dtype, device=dev)
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
    widths = [min(b, n) for b, n in zip(budgets, cand)]
    if into is not None:  # the query rows and the top-B rows are the batch rows (padding slots differ)
        return _fill_static(into, fire_j, widths, [obs_pos, q_req, indptr, cur_rows, fire_j, fire_j, sel_seq,
                                                   budgets, cand], rpi)
    parts = [obs_pos, q_req, indptr, cur_rows, fire_j, sel_seq, budgets, cand]
    packed = h2d(torch.tensor([x for part in parts for x in part], dtype=torch.int64), dev)
    views = packed.split([len(part) for part in parts])
    # top-B's masks are the same at every layer of the step: built once here
    excluded, valid = decode_topb_masks(views[6], views[7], max(sel_seq), max(widths))
    kw = dict(dtype=torch.float32, device=dev)
    vsum_buf, lse_buf = (torch.empty(len(fire_j), runner.shape.num_kv_heads, max(sel_seq), **kw),
                         torch.empty(runner.shape.num_qo_heads, r_total, **kw)) if runner.use_kernels else (None, None)
    split_len = runner.lse_split_keys
    spans_n = -(-max(sel_seq) // split_len)
    lse_part_buf = torch.empty(2, spans_n, runner.shape.num_qo_heads, r_total, **kw) if runner.use_kernels else None
    return dict(obs_buf=obs_buf, vsum_buf=vsum_buf, lse_buf=lse_buf, split_len=split_len, num_splits=spans_n,
                lse_part_buf=lse_part_buf,
                obs_pos=views[0], q_req=views[1],
                qo_indptr=views[2], cur_rows=views[3], fire_dev=views[4], fire_q=views[4], sel_seq=views[5],
                budgets=views[6], cand_seq=views[7],
                excluded=excluded, valid=valid, max_len=max(sel_seq), width=max(widths), max_qo_len=max(counts), rpi=rpi[views[4].to(rpi.device)],
                widths=list(zip(fire_j, widths)))


# the re-selection's LSE pass walks the keys in spans of this many (vertical_sums_batched's split_len): eager and
# graph-replayed steps (whose key width is padded to the captured one) then compute the same bits
SELECT_SPLIT_KEYS = 1024


def selection_buffers(runner, f_cap: int, key_width: int, topb_width: int, trash_row: int,
                      dtype: torch.dtype) -> dict:
    """The static selection of a captured re-selecting decode graph (:func:`plan_selection` ``into``): fixed
    buffers for ``f_cap`` re-selecting requests of ``n_d`` observation queries each, scored over up to
    ``key_width`` keys, top-B ``topb_width`` wide, observation queries in ``dtype``; padding slots write their
    top-B into row ``trash_row`` of the step's top-B buffer. Filled as padding (no rows, length 0) until a step is planned into it. Memory: the
    observation queries ``L x (f_cap * n_d + 1) x Hq x D`` in the KV dtype, scores ``f_cap x Hk x key_width``
    fp32 and the masks."""
    cfg, sh, dev = runner.cfg, runner.shape, runner.device
    n_obs = f_cap * cfg.n_d
    lens = [n_obs, n_obs, f_cap + 1, f_cap, f_cap, f_cap, f_cap, f_cap, f_cap]
    packed = torch.zeros(sum(lens), dtype=torch.int64, device=dev)
    views = packed.split(lens)
    kw = dict(dtype=torch.float32, device=dev)
    spans_n = -(-key_width // runner.lse_split_keys)
    into = dict(obs_buf=torch.zeros(sh.num_layers, n_obs + 1, sh.num_qo_heads, sh.head_dim, dtype=dtype, device=dev),
                vsum_buf=torch.zeros(f_cap, sh.num_kv_heads, key_width, **kw) if runner.use_kernels else None,
                lse_buf=torch.zeros(sh.num_qo_heads, n_obs + 1, **kw) if runner.use_kernels else None,
                lse_part_buf=torch.zeros(2, spans_n, sh.num_qo_heads, n_obs + 1, **kw) if runner.use_kernels else None,
                split_len=runner.lse_split_keys, num_splits=spans_n, packed=packed,
                obs_pos=views[0], q_req=views[1], qo_indptr=views[2], cur_rows=views[3], fire_q=views[4],
                fire_dev=views[5], sel_seq=views[6], budgets=views[7], cand_seq=views[8],
                excluded=torch.ones(f_cap, 1, key_width, dtype=torch.bool, device=dev),
                valid=torch.zeros(f_cap, 1, topb_width, dtype=torch.bool, device=dev),
                rpi=torch.zeros(f_cap, dtype=torch.int64, device=dev),
                max_len=key_width, width=topb_width, max_qo_len=cfg.n_d, f_cap=f_cap, trash_row=trash_row,
                n_obs=n_obs, widths=[])
    _fill_static(into, [], [], [[] for _ in lens], None)
    return into


def _fill_static(into: dict, fire_j, widths, parts, rpi) -> dict:
    """``parts`` (host lists in :func:`selection_buffers`' packed order) padded to the static slots and copied in
    one host->device copy; the masks and request indices rebuilt on the device. Returns the step's dict."""
    f_cap, n_obs, n = into["f_cap"], into["n_obs"], len(fire_j)
    if n > f_cap:
        raise RuntimeError(f"sglang-sparse loopserve: {n} re-selecting rows exceed the graph's {f_cap} slots")
    obs_pos, q_req, indptr, cur_rows, fire_q, fire_dev, sel_seq, budgets, cand = parts
    r_total = len(obs_pos)
    if r_total > n_obs:
        raise RuntimeError(f"sglang-sparse loopserve: {r_total} observation rows exceed the graph's {n_obs}")
    pad_rows, pad_req = n_obs - r_total, f_cap - n
    padded = [obs_pos + [0] * pad_rows, q_req + [f_cap] * pad_rows, (indptr or [0]) + [r_total] * pad_req,
              cur_rows + [n_obs] * pad_req, fire_q + [0] * pad_req, fire_dev + [into["trash_row"]] * pad_req,
              sel_seq + [0] * pad_req, budgets + [1] * pad_req, cand + [0] * pad_req]
    packed = into["packed"]
    packed.copy_(h2d(torch.tensor([x for part in padded for x in part], dtype=torch.int64), packed.device),
                 non_blocking=True)
    excluded, valid = decode_topb_masks(into["budgets"], into["cand_seq"], into["max_len"], into["width"])
    into["excluded"].copy_(excluded)
    into["valid"].copy_(valid)
    if rpi is not None:
        into["rpi"].copy_(rpi[into["fire_q"].to(rpi.device)])
    return {**into, "widths": list(zip(fire_j, widths))}


def reselect(runner, d, sel, q_s, k_buf, rtt, lid, scale) -> None:
    """Alg. 3 / Eq. 7 for all re-selecting rows of this step, one layer: their observation queries
    (earlier ones planned in ``obs_buf``, this step's from ``q_s [nS, Hq, D]``), one batched vertical-sum
    estimation, one top-B, one scatter into the step's ``topb [nS, L, Hk, W]``."""
    from flashinfer_ext.loopserve.vs_estimate_batched import (decode_topb_masked, vertical_sums_batched,
                                                    vertical_sums_batched_reference)

    q_obs = sel["obs_buf"][lid]
    if not runner.lastwindow:
        q_obs.index_copy_(0, sel["cur_rows"], q_s.index_select(0, sel["fire_q"]).to(q_obs.dtype))
    n_obs = sel["q_req"].shape[0]  # a static selection's obs_buf has one more (trash) row
    args = (q_obs[:n_obs], sel["obs_pos"], sel["q_req"], k_buf, rtt, sel["rpi"], sel["sel_seq"], sel["max_len"])
    if runner.use_kernels:
        v_sum = vertical_sums_batched(*args, sm_scale=scale, out=sel["vsum_buf"], lse_buf=sel["lse_buf"],
                                      qo_indptr=sel["qo_indptr"], max_qo_len=sel["max_qo_len"],
                                      split_len=sel["split_len"], lse_part_buf=sel["lse_part_buf"],
                                      target_programs=runner.target_programs)
    else:
        v_sum = vertical_sums_batched_reference(*args, sm_scale=scale)
    if runner.lastwindow:  # SnapKV: pool the scores over neighbouring positions, never pick the sink
        v_sum = snapkv_pool(v_sum, runner.cfg.pool_kernel, runner.cfg.sink_tokens)
    lists = decode_topb_masked(v_sum, sel["excluded"], sel["valid"])
    d.get("topb_rows", d["topb"])[sel["fire_dev"], lid, :, : sel["width"]] = lists


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
