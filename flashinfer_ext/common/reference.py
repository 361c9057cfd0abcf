"""Pure-torch fp32 references for every kernel in ``flashinfer_ext`` (slow, loop-based, exact).

Supports: block metadata from scratch, cuboid/mean criticality with explicit GQA
groups, dense decode, progressive (PSA Alg. 1) decode over per-(request, KV head)
block lists with the same micro-batch / stop-test semantics as the Triton kernel,
base-2 log-sum-exp state merging (FlashInfer's ``merge_state`` convention), and the
true attention mass kept by a set of blocks (measured against full attention).

Cautions: meant for tests and small benchmarks only (python loops over requests and
heads). All log-sum-exps here are BASE 2: ``lse = log2(sum_j exp(q.k_j * sm_scale))``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gather_kv", "block_meta_reference", "criticality_reference", "forced_and_limit",
           "dense_decode_reference", "progressive_decode_reference", "merge_states_reference",
           "kept_mass_reference", "psa_decode_reference",
           "bound_suffix_reference", "rank_reference"]

LOG2E = 1.0 / math.log(2.0)


def gather_kv(buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_idx: int, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]`` fp32 copy of one request's keys or values."""
    slots = req_to_token[req_pool_idx, :seq_len].long()
    return buffer[slots].float()


def block_meta_reference(k_buffer, req_to_token, req_pool_indices, seq_lens, block_size):
    """Per request ``(kmin, kmax, kmean)`` each ``[n_blocks, num_kv_heads, head_dim]`` fp32, from scratch."""
    out = []
    for r in range(len(req_pool_indices)):
        k = gather_kv(k_buffer, req_to_token, int(req_pool_indices[r]), int(seq_lens[r]))
        mins, maxs, means = [], [], []
        for s in range(0, k.shape[0], block_size):
            blk = k[s: s + block_size]
            mins.append(blk.amin(0))
            maxs.append(blk.amax(0))
            means.append(blk.mean(0))
        out.append((torch.stack(mins), torch.stack(maxs), torch.stack(means)))
    return out


def forced_and_limit(seq_len: int, block_size: int, sink_blocks: int, local_blocks: int, max_blocks: int):
    """``(n_blocks, n_forced, limit)``: blocks of a request, forced (sink + local) count, read cap."""
    n_blocks = -(-seq_len // block_size)
    n_forced = min(n_blocks, sink_blocks + local_blocks)
    limit = min(n_blocks, n_forced + max_blocks)
    return n_blocks, n_forced, limit


def criticality_reference(q, kmin, kmax, kmean, block_table, seq_lens, *, block_size, num_blocks,
                          sink_blocks, local_blocks, criticality="cuboid", group_reduce="max"):
    """Block scores ``[batch, num_kv_heads, num_blocks]`` fp32.

    ``q``: ``[batch, num_qo_heads, head_dim]``; ``kmin/kmax/kmean``: ``[num_rows, num_kv_heads, head_dim]``;
    ``block_table``: ``[batch, >= num_blocks]`` meta rows. Sink/local blocks score ``+inf``, blocks past the
    end ``-inf``. GQA: each query head of the group gets its own bound, then ``max`` or ``sum`` over the group.
    """
    batch, num_qo_heads, _ = q.shape
    num_kv_heads = kmin.shape[1]
    group = num_qo_heads // num_kv_heads
    scores = torch.full((batch, num_kv_heads, num_blocks), float("-inf"))
    for r in range(batch):
        n_blocks = -(-int(seq_lens[r]) // block_size)
        rows = block_table[r, :n_blocks].long().cpu()
        for h in range(num_kv_heads):
            qg = q[r, h * group:(h + 1) * group].float().cpu()  # [G, d]
            if criticality == "cuboid":
                mn = kmin[rows, h].float().cpu()
                mx = kmax[rows, h].float().cpu()
                ub = torch.maximum(qg[:, None, :] * mn[None], qg[:, None, :] * mx[None]).sum(-1)  # [G, nb]
            else:
                ub = qg @ kmean[rows, h].float().cpu().T
            s = ub.amax(0) if group_reduce == "max" else ub.sum(0)
            forced = torch.zeros(n_blocks, dtype=torch.bool)
            forced[:sink_blocks] = True
            if local_blocks > 0:
                forced[max(0, n_blocks - local_blocks):] = True
            scores[r, h, :n_blocks] = torch.where(forced, torch.full_like(s, float("inf")), s)
    return scores


def _scores_base2(qg, k, sm_scale):
    return (qg @ k.T) * (sm_scale * LOG2E)  # [G, L]


def dense_decode_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale):
    """Full attention: ``o`` ``[batch, num_qo_heads, head_dim]`` fp32, ``lse`` ``[batch, num_qo_heads]`` base 2."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_qo_heads // num_kv_heads
    o = torch.zeros(batch, num_qo_heads, head_dim)
    lse = torch.zeros(batch, num_qo_heads)
    for r in range(batch):
        k = gather_kv(k_buffer, req_to_token, int(req_pool_indices[r]), int(seq_lens[r])).cpu()
        v = gather_kv(v_buffer, req_to_token, int(req_pool_indices[r]), int(seq_lens[r])).cpu()
        for h in range(num_kv_heads):
            s2 = _scores_base2(q[r, h * group:(h + 1) * group].float().cpu(), k[:, h], sm_scale)
            l2 = torch.logsumexp(s2 / LOG2E, dim=-1) * LOG2E
            o[r, h * group:(h + 1) * group] = torch.exp2(s2 - l2[:, None]) @ v[:, h]
            lse[r, h * group:(h + 1) * group] = l2
    return o, lse


def bound_suffix_reference(sorted_row, *, sm_scale, block_size):
    """``[n + 1]`` fp32: entry ``e`` = ``log2 sum_{j >= e} block_size * exp(sm_scale * s_j)`` over finite scores."""
    s = sorted_row.float().cpu()
    x = torch.where(torch.isfinite(s), s * (sm_scale * LOG2E) + math.log2(block_size),
                    torch.full_like(s, float("-inf")))
    out = torch.full((s.numel() + 1,), float("-inf"))
    run = float("-inf")
    for e in range(s.numel() - 1, -1, -1):
        run = float(torch.logaddexp2(torch.tensor(run), x[e]))
        out[e] = run
    return out


def _eps_of(epsilon, r):
    if isinstance(epsilon, (int, float)):
        return float(epsilon)
    return float(epsilon[r])


def progressive_decode_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                 block_lists, list_lens, n_forced, *, block_size, sm_scale,
                                 epsilon, micro_batch_blocks, chunk_ends=None, estimator="paper",
                                 sorted_scores=None, calib_slack=2.0, return_kept_est=False, sketch_totals=None):
    """PSA Alg. 1 over given rank orders, chunk-granular: the semantics of the Triton decode paths.

    ``block_lists``: ``[batch, num_kv_heads, L]`` logical block ids in attend order (forced first);
    ``list_lens``: ``[batch, num_kv_heads]`` how many list entries may be read; ``n_forced``: ``[batch]``.
    ``epsilon``: a float or a per-request sequence (``>= 1``: no stop test for that row).
    Chunks: ``[0, n_forced)`` (no test), then ranked chunks ending at ``n_forced + chunk_ends[i]``
    (default: every ``micro_batch_blocks``; the PSA wrapper passes ``config.ranked_chunk_ends``).
    After each ranked chunk, per query head of the group: AS_acc = mass read, and the remaining-mass
    estimate R (``estimator``): 'paper' AS_min * N_left (AS_min = smallest mass of a full ranked block
    read, N_left = n_blocks - read); 'bound' U(read) (:func:`bound_suffix_reference` of
    ``sorted_scores`` ``[batch, num_kv_heads, >= L]``, the cuboid scores in rank order); 'calibrated'
    U(read) * 2^min(0, delta + calib_slack) with delta = max over ranked blocks read of
    log2(block mass) - log2(block_size * exp(sm_scale * score)) (0 while none); 'mean' (scores = q . mean key)
    U(read) * 2^(delta + calib_slack), not clamped (delta 0 while none); 'sketch' (``sorted_scores`` = the sketch's
    group-max shares, :func:`flashinfer_ext.psa.key_sketch.sketch_scores_reference`) log2 sum of 2^share over the
    unread ranks + ``sketch_totals[r, head]`` + calib_slack. The pair stops once
    every head has ``AS_acc / (AS_acc + R) >= epsilon``, or at the end of its list / context.
    Returns ``(o fp32 [batch, num_qo_heads, head_dim], lse base 2 [batch, num_qo_heads], nread
    [batch, num_kv_heads])`` and, with ``return_kept_est``, ``kept_est [batch, num_kv_heads]`` (the
    smallest estimate over the group at the stop chunk; 1.0 when nothing is left unread).
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_qo_heads // num_kv_heads
    m = micro_batch_blocks
    o = torch.zeros(batch, num_qo_heads, head_dim)
    lse = torch.zeros(batch, num_qo_heads)
    nread = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    kept_est = torch.ones(batch, num_kv_heads)
    sl2 = sm_scale * LOG2E
    for r in range(batch):
        seq_len = int(seq_lens[r])
        n_blocks = -(-seq_len // block_size)
        k = gather_kv(k_buffer, req_to_token, int(req_pool_indices[r]), seq_len).cpu()
        v = gather_kv(v_buffer, req_to_token, int(req_pool_indices[r]), seq_len).cpu()
        eps = _eps_of(epsilon, r)
        for h in range(num_kv_heads):
            s2 = _scores_base2(q[r, h * group:(h + 1) * group].float().cpu(), k[:, h], sm_scale)  # [G, L]
            lst = [int(x) for x in block_lists[r, h, : int(list_lens[r, h])]]
            nf = min(int(n_forced[r]), len(lst))
            ends = chunk_ends if chunk_ends is not None else list(range(m, max(len(lst) - nf, 0) + m, m))
            bounds = [nf + e for e in ends]
            # absolute base-2 log mass of every block, per query head
            blk_lm = torch.stack([torch.logsumexp(s2[:, b * block_size:(b + 1) * block_size] / LOG2E, -1) * LOG2E
                                  for b in range(n_blocks)], dim=1)  # [G, n_blocks]
            full = [min(seq_len, (b + 1) * block_size) - b * block_size == block_size for b in range(n_blocks)]
            srt = sorted_scores[r, h].float().cpu() if sorted_scores is not None else None
            if estimator == "sketch":  # shares are base-2 logs already: sum 2^share
                sfx = bound_suffix_reference(srt, sm_scale=math.log(2.0), block_size=1)
            else:
                sfx = (bound_suffix_reference(srt, sm_scale=sm_scale, block_size=block_size)
                       if estimator != "paper" else None)
            cur = nf
            lmin = torch.full((group,), float("inf"))
            dmax = torch.full((group,), float("-inf"))
            est = 1.0
            for end in bounds:
                if cur >= len(lst):
                    break
                end = min(end, len(lst))
                for rank in range(cur, end):
                    b = lst[rank]
                    if full[b]:
                        lmin = torch.minimum(lmin, blk_lm[:, b])
                    if estimator not in ("paper", "sketch"):
                        dmax = torch.maximum(dmax, blk_lm[:, b] - (float(srt[rank]) * sl2 + math.log2(block_size)))
                cur = end
                lse_acc = torch.logsumexp(blk_lm[:, lst[:cur]] / LOG2E, -1) * LOG2E
                n_left = n_blocks - cur
                if n_left <= 0:
                    rem = torch.full((group,), float("-inf"))
                elif estimator == "paper":
                    rem = lmin + math.log2(n_left)
                else:
                    rem = torch.full((group,), float(sfx[cur]))
                    if estimator == "calibrated":
                        rem = rem + torch.where(dmax == float("-inf"), torch.zeros_like(dmax),
                                                torch.clamp(dmax + calib_slack, max=0.0))
                    elif estimator == "mean":  # an estimate: raised by the largest gap seen, never clamped
                        rem = rem + torch.where(dmax == float("-inf"), torch.zeros_like(dmax), dmax) + calib_slack
                    elif estimator == "sketch":
                        rem = rem + sketch_totals[r, h * group:(h + 1) * group].float().cpu() + calib_slack
                p = torch.exp2(lse_acc - torch.logaddexp2(lse_acc, rem))
                est = float(torch.nan_to_num(p, nan=0.0).min())
                if n_left <= 0 or cur >= len(lst):
                    break
                if eps < 1.0 and bool((lse_acc + math.log2(1.0 - eps) >= math.log2(eps) + rem).all()):
                    break
            kept_est[r, h] = est
            read = lst[:cur]
            nread[r, h] = cur
            tok = torch.cat([torch.arange(b * block_size, min(seq_len, (b + 1) * block_size)) for b in read])
            s_read = s2[:, tok]
            l2 = torch.logsumexp(s_read / LOG2E, -1) * LOG2E
            o[r, h * group:(h + 1) * group] = torch.exp2(s_read - l2[:, None]) @ v[tok, h]
            lse[r, h * group:(h + 1) * group] = l2
    if return_kept_est:
        return o, lse, nread, kept_est
    return o, lse, nread


def merge_states_reference(v_a, s_a, v_b, s_b):
    """Merge two partial attention states (base-2 lse), as ``flashinfer.merge_state``.

    ``v_*``: ``[n, num_heads, head_dim]``; ``s_*``: ``[n, num_heads]`` fp32. Returns fp32 ``(v, s)``.
    """
    s_a, s_b = s_a.float(), s_b.float()
    s = torch.logaddexp2(s_a, s_b)
    w_a = torch.exp2(s_a - s)[..., None]
    w_b = torch.exp2(s_b - s)[..., None]
    return v_a.float() * w_a + v_b.float() * w_b, s


def kept_mass_reference(q, k_buffer, req_to_token, req_pool_indices, seq_lens, block_lists, nread,
                        *, block_size, sm_scale):
    """True softmax mass of the blocks read, ``[batch, num_qo_heads]`` fp32 (1.0 = everything kept)."""
    batch, num_qo_heads, _ = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_qo_heads // num_kv_heads
    kept = torch.zeros(batch, num_qo_heads)
    for r in range(batch):
        seq_len = int(seq_lens[r])
        k = gather_kv(k_buffer, req_to_token, int(req_pool_indices[r]), seq_len).cpu()
        for h in range(num_kv_heads):
            s2 = _scores_base2(q[r, h * group:(h + 1) * group].float().cpu(), k[:, h], sm_scale)
            p = torch.exp2(s2 - s2.amax(-1, keepdim=True))
            p = p / p.sum(-1, keepdim=True)
            mask = torch.zeros(seq_len, dtype=torch.bool)
            for b in block_lists[r, h, : int(nread[r, h])].tolist():
                mask[b * block_size: (b + 1) * block_size] = True
            kept[r, h * group:(h + 1) * group] = p[:, mask].sum(-1)
    return kept


def rank_reference(scores, prefix):
    """Rank order ``[batch, num_kv_heads, n]`` int64: the top ``prefix`` blocks by descending score (stable),
    then the others in block order (``prefix == 0``: a full stable descending sort)."""
    full = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if not prefix or prefix >= scores.shape[-1]:
        return full
    top = full[..., :prefix]
    rest = torch.sort(full[..., prefix:], dim=-1).values
    return torch.cat([top, rest], dim=-1)


def psa_decode_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, config, *,
                         block_size, sm_scale, epsilon=None, return_kept_est=False):
    """Whole PSA decode from scratch (metadata, scores, stable rank, chunk-granular progressive attention).

    Rank order: by the criticality scores, or (``config.rank_by == 'mean'``) by the group max of
    ``q . mean key``; the estimator always sees the criticality scores of the blocks in rank order.

    ``config``: a :class:`flashinfer_ext.psa.config.PsaDecodeConfig` (estimator, chunk schedule, caps);
    ``epsilon``: ``None`` (``config.epsilon``) or a per-request sequence (``>= 1``: every block, no cap).
    Returns ``(o, lse, nread, order)`` with ``order`` ``[batch, num_kv_heads, max_n_blocks]`` int64, plus
    ``kept_est`` with ``return_kept_est``.
    """
    batch = q.shape[0]
    if config.criticality == "sketch":
        return _psa_sketch_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, config,
                                     block_size=block_size, sm_scale=sm_scale, epsilon=epsilon,
                                     return_kept_est=return_kept_est)
    metas = block_meta_reference(k_buffer, req_to_token, req_pool_indices, seq_lens, block_size)
    num_blocks = max(mm[0].shape[0] for mm in metas)
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    rows = torch.zeros(batch * num_blocks, num_kv_heads, head_dim)
    kmin, kmax, kmean = rows.clone(), rows.clone(), rows.clone()
    table = torch.arange(batch * num_blocks).view(batch, num_blocks)
    for r, (mn, mx, me) in enumerate(metas):
        n = mn.shape[0]
        kmin[r * num_blocks: r * num_blocks + n] = mn
        kmax[r * num_blocks: r * num_blocks + n] = mx
        kmean[r * num_blocks: r * num_blocks + n] = me
    scores = criticality_reference(q, kmin, kmax, kmean, table, seq_lens, block_size=block_size,
                                   num_blocks=num_blocks, sink_blocks=config.sink_blocks,
                                   local_blocks=config.local_blocks, criticality=config.criticality,
                                   group_reduce=config.group_reduce)
    rank_scores = scores
    if config.rank_by == "mean" and (config.criticality, config.group_reduce) != ("mean", "max"):
        rank_scores = criticality_reference(q, kmin, kmax, kmean, table, seq_lens, block_size=block_size,
                                            num_blocks=num_blocks, sink_blocks=config.sink_blocks,
                                            local_blocks=config.local_blocks, criticality="mean",
                                            group_reduce="max")
    order = rank_reference(rank_scores, config.ranking_prefix())
    eps = [config.epsilon] * batch if epsilon is None else [float(e) for e in epsilon]
    list_lens, n_forced = _list_caps(config, seq_lens, eps, num_kv_heads, block_size)
    out = progressive_decode_reference(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, order, list_lens, n_forced,
        block_size=block_size, sm_scale=sm_scale, epsilon=eps, micro_batch_blocks=config.micro_batch_blocks,
        chunk_ends=config.ranked_chunk_ends(num_blocks), estimator=config.estimator,
        sorted_scores=torch.gather(scores, 2, order),
        calib_slack=config.calib_slack, return_kept_est=True)
    o, lse, nread, kept_est = out
    if return_kept_est:
        return o, lse, nread, order, kept_est
    return o, lse, nread, order


def _list_caps(config, seq_lens, eps, num_kv_heads, block_size):
    """``(list_lens [batch, num_kv_heads] int32, n_forced [batch] int32)``: the ranks a pair may read (every block
    for a row with epsilon >= 1, else the forced blocks + ``max_blocks``) and its forced blocks."""
    batch = len(eps)
    list_lens = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    n_forced = torch.zeros(batch, dtype=torch.int32)
    for r in range(batch):
        n_blocks, nf, limit = forced_and_limit(int(seq_lens[r]), block_size, config.sink_blocks,
                                               config.local_blocks, config.max_blocks)
        n_forced[r] = nf
        list_lens[r] = n_blocks if eps[r] >= 1.0 else limit
    return list_lens, n_forced


def _psa_sketch_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, config, *,
                          block_size, sm_scale, epsilon, return_kept_est):
    """:func:`psa_decode_reference` for criticality / estimator 'sketch': int4 sketch shares rank the blocks and
    drive the stop test (:mod:`flashinfer_ext.psa.key_sketch`)."""
    from flashinfer_ext.psa.key_sketch import sketch_scores_reference

    batch = q.shape[0]
    num_blocks = max(-(-int(n) // block_size) for n in seq_lens)
    scores, totals, mass = sketch_scores_reference(q, k_buffer, req_to_token, req_pool_indices, seq_lens,
                                                   block_size=block_size, sm_scale=sm_scale, num_blocks=num_blocks,
                                                   sink_blocks=config.sink_blocks, local_blocks=config.local_blocks)
    eps = [config.epsilon] * batch if epsilon is None else [float(e) for e in epsilon]
    list_lens, n_forced = _list_caps(config, seq_lens, eps, k_buffer.shape[1], block_size)
    if config.schedule == "select":
        return _sketch_select_attend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, config, mass,
                                     eps, list_lens, block_size=block_size, sm_scale=sm_scale,
                                     return_kept_est=return_kept_est)
    order = rank_reference(scores, config.ranking_prefix())
    o, lse, nread, kept_est = progressive_decode_reference(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, order, list_lens, n_forced,
        block_size=block_size, sm_scale=sm_scale, epsilon=eps, micro_batch_blocks=config.micro_batch_blocks,
        chunk_ends=config.ranked_chunk_ends(num_blocks), estimator="sketch",
        sorted_scores=torch.gather(scores, 2, order), calib_slack=config.calib_slack, return_kept_est=True,
        sketch_totals=totals)
    if return_kept_est:
        return o, lse, nread, order, kept_est
    return o, lse, nread, order


def _sketch_select_attend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, config, mass, eps,
                          list_lens, *, block_size, sm_scale, return_kept_est):
    """Schedule 'select': the blocks of :func:`flashinfer_ext.psa.sketch_select.sketch_select_reference`, attended
    exactly. ``order`` holds each pair's selected blocks in block order (its first ``nread`` entries)."""
    from flashinfer_ext.psa.sketch_select import sketch_select_reference

    batch, num_kv_heads = q.shape[0], k_buffer.shape[1]
    lists, kept_est = sketch_select_reference(mass, seq_lens, eps, list_lens, block_size=block_size,
                                              sink_blocks=config.sink_blocks, local_blocks=config.local_blocks,
                                              calib_slack=config.calib_slack)
    order = torch.zeros(batch, num_kv_heads, mass.shape[-1], dtype=torch.int64)
    lens = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    for r in range(batch):
        for h in range(num_kv_heads):
            lens[r, h] = len(lists[r][h])
            order[r, h, : len(lists[r][h])] = torch.tensor(lists[r][h], dtype=torch.int64)
    # the selected lists attended whole: the progressive reference with no stop test (epsilon 1)
    o, lse, nread = progressive_decode_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                                 order, lens, torch.zeros(batch, dtype=torch.int32),
                                                 block_size=block_size, sm_scale=sm_scale, epsilon=1.0,
                                                 micro_batch_blocks=config.micro_batch_blocks)
    if return_kept_est:
        return o, lse, nread, order, kept_est
    return o, lse, nread, order
