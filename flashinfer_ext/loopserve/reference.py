"""Pure-torch fp32/fp64 references of the LoopServe building blocks (no Triton, no sglang).

Supports: one request at a time in SGLang's KV layout (``k_buffer[layer]`` is
``[num_slots, num_kv_heads, head_dim]`` post-RoPE, reached through the request's
``req_to_token`` row, here called ``token_slots`` = ``req_to_token[req_pool_idx]``).

  * :func:`vs_estimate_reference`      vertical / slash line sums of sampled rows (LoopServe Alg. 2 l.4-5)
  * :func:`vs_select_alg2_reference`   Alg. 2's sequential greedy, line by line (a python loop: reference only)
  * :func:`vs_select_rule_reference`   ``vs_select``'s vectorised rule, one list at a time, kept lines as masks
  * :func:`vs_mask_reference`          the exact ``[num_kv_heads, num_tokens, seq_len]`` mask sparse prefill computes
  * :func:`vs_prefill_reference`       dense masked attention with that mask (o, base-2 lse)
  * :func:`decode_topb_reference`      Alg. 3 / Eq. 7 top-B tokens per KV head from the last n_d queries

Conventions shared with the kernels (``vs_estimate``, ``vs_select``, ``vs_prefill``, ``decode_topb``):
  * lines are per KV HEAD: the attention of the G query heads of a KV head's group is SUMMED
    (each sampled row of each query head carries mass 1, so a KV head's total is ``G * rows``).
    One line set per KV head is what lets sparse prefill and decode read each key once per group.
  * a slash line is indexed by its offset ``d = q_pos - k_pos >= 0``; a vertical line by ``k_pos``.
  * ``*_max`` is the largest single entry of a line in the group-summed matrix: the overlap
    bound of Alg. 2 (a slash and a vertical meet in at most one entry of the sampled matrix,
    because sampled rows have distinct positions).
Cautions: these build dense ``[rows, seq_len]`` / ``[tokens, seq_len]`` matrices; use small shapes.
"""

from __future__ import annotations

import torch

__all__ = ["gather_keys", "vs_estimate_reference", "vs_select_alg2_reference", "vs_select_rule_reference",
           "vs_mask_reference",
           "vs_prefill_reference", "decode_topb_reference", "covered_mass_reference"]


def gather_keys(buffer: torch.Tensor, token_slots: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]`` fp32 rows of ``buffer`` for positions ``0..seq_len-1``."""
    return buffer[token_slots[:seq_len].long()].float()


def _sampled_probs(q_rows, q_pos, k_buffer, token_slots, seq_len, sm_scale):
    """Per query head causal softmax ``[num_qo_heads, rows, seq_len]`` (fp32) of the sampled rows."""
    k = gather_keys(k_buffer, token_slots, seq_len)  # [N, Hk, D]
    hq, hk = q_rows.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, dim=1)  # [N, Hq, D]
    s = torch.einsum("rhd,nhd->hrn", q_rows.float(), k) * sm_scale
    pos = q_pos.long()
    causal = torch.arange(seq_len)[None, :] <= pos[:, None]  # [R, N]
    s = s.masked_fill(~causal[None], float("-inf"))
    return torch.softmax(s, dim=-1)


def vs_estimate_reference(q_rows: torch.Tensor, q_pos: torch.Tensor, k_buffer: torch.Tensor,
                          token_slots: torch.Tensor, seq_len: int, sm_scale: float):
    """Line sums of the sampled rows, per KV head (group-summed).

    Args: q_rows ``[R, Hq, D]``; q_pos ``[R]`` distinct positions < seq_len; k_buffer
    ``[slots, Hk, D]``; token_slots ``[>= seq_len]``.
    Returns ``(v_sum, v_max, s_sum, s_max)``, each ``[Hk, seq_len]`` fp32: vertical sums/max
    entries indexed by key position, slash sums/max entries indexed by offset ``q_pos - k_pos``.
    """
    p = _sampled_probs(q_rows, q_pos, k_buffer, token_slots, seq_len, sm_scale)  # [Hq, R, N]
    hq, r, n = p.shape
    hk = k_buffer.shape[1]
    pg = p.view(hk, hq // hk, r, n).sum(1)  # [Hk, R, N] group-summed entries
    v_sum = pg.sum(1)
    v_max = pg.amax(1)
    off = (q_pos.long()[:, None] - torch.arange(n)[None, :])  # [R, N]
    valid = off >= 0
    idx = off.clamp(min=0).expand(hk, r, n).reshape(hk, -1)
    vals = torch.where(valid[None], pg, torch.zeros(())).reshape(hk, -1)
    s_sum = torch.zeros(hk, n).scatter_add_(1, idx, vals)
    s_max = torch.zeros(hk, n).scatter_reduce_(1, idx, vals, reduce="amax", include_self=True)
    return v_sum, v_max, s_sum, s_max


def _line_lengths(seq_len: int, prefix_len: int):
    """Cost of a line in the sparse prefill of query positions ``[prefix_len, seq_len)``:
    vertical ``k`` and slash ``d`` both cover ``seq_len - max(prefix_len, k or d)`` entries."""
    ar = torch.arange(seq_len)
    return (seq_len - ar.clamp(min=prefix_len)).double()


def vs_select_alg2_reference(v_sum, v_max, s_sum, s_max, *, seq_len: int, prefix_len: int, alpha: float,
                             sink_tokens: int, local_window: int):
    """LoopServe Alg. 2, sequential, per KV head (fp64). Sink verticals and local slashes are taken
    first (with the same overlap accounting); then at each step the top remaining slash and vertical
    (lists sorted by weight) are compared by ``(w - ol_other) / (l - |other set|)`` and the larger
    one is added; ``ol_s``/``ol_v`` grow by the added line's max entry; stop once
    ``sum >= alpha * total``. Returns ``(verticals, slashes, covered_lower_bound)`` as lists per head
    (python sets) and the bound ``sum / total`` per head.
    """
    hk = v_sum.shape[0]
    lens = _line_lengths(seq_len, prefix_len)
    out_v, out_s, cov = [], [], []
    for h in range(hk):
        vs, vm, ss, sm = (t[h].double() for t in (v_sum, v_max, s_sum, s_max))
        total = float(vs.sum())
        target = alpha * total
        sel_v, sel_s = set(), set()
        ol_s = ol_v = acc = 0.0

        def add_v(k):
            nonlocal ol_v, acc
            acc += max(float(vs[k]) - ol_s, 0.0)
            ol_v += float(vm[k])
            sel_v.add(k)

        def add_s(d):
            nonlocal ol_s, acc
            acc += max(float(ss[d]) - ol_v, 0.0)
            ol_s += float(sm[d])
            sel_s.add(d)

        for k in range(min(sink_tokens, seq_len)):
            add_v(k)
        for d in range(min(local_window, seq_len)):
            add_s(d)
        v_order = [k for k in torch.sort(vs, descending=True, stable=True).indices.tolist() if k not in sel_v]
        s_order = [d for d in torch.sort(ss, descending=True, stable=True).indices.tolist() if d not in sel_s]
        iv = is_ = 0
        while acc < target and (iv < len(v_order) or is_ < len(s_order)):
            take_s = iv >= len(v_order)
            if iv < len(v_order) and is_ < len(s_order):
                s, v = s_order[is_], v_order[iv]
                ds = (float(ss[s]) - ol_v) / max(float(lens[s]) - len(sel_v), 1.0)
                dv = (float(vs[v]) - ol_s) / max(float(lens[v]) - len(sel_s), 1.0)
                take_s = ds >= dv
            if take_s:
                add_s(s_order[is_])
                is_ += 1
            else:
                add_v(v_order[iv])
                iv += 1
        out_v.append(sel_v)
        out_s.append(sel_s)
        cov.append(acc / total if total > 0 else 1.0)
    return out_v, out_s, cov


def vs_select_rule_reference(v_sum, v_max, s_sum, s_max, *, prefix_len: int, alpha: float, sink_tokens: int,
                             local_window: int, split_candidates: int):
    """The rule of :func:`flashinfer_ext.loopserve.vs_select.vs_select` (its module docstring) written plainly: each
    list sorted on its own, the split search in torch (:func:`~flashinfer_ext.loopserve.vs_split_search.split_search_reference`),
    the kept lines marked in a ``[Hk, n]`` mask and compacted. Inputs ``[Hk, n]`` fp32; returns
    ``(v_idx, v_cnt, s_idx, s_cnt, covered_lb)`` as :class:`~flashinfer_ext.loopserve.vs_select.VSSelection` holds them
    (``alpha < 1``)."""
    from .vs_split_search import split_candidates as candidates, split_search_reference

    hk, n = v_sum.shape
    ar = torch.arange(n)
    lens = (n - ar.clamp(min=prefix_len)).to(torch.float32)

    def ordered(wsum, wmax, n_forced):
        key = torch.where(ar < n_forced, torch.full_like(wsum, float("inf")), wsum / lens)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        return order, torch.stack([wsum, wmax, lens.expand(hk, n)]).gather(2, order.expand(3, hk, n))

    def compact(mask):
        idx = torch.where(mask, ar, n).sort(dim=1).values
        return torch.where(idx >= n, -1, idx).to(torch.int32), mask.sum(1, dtype=torch.int32)

    n_fs, n_fv = min(local_window, n), min(sink_tokens, n)
    v_order, v_planes = ordered(v_sum.float(), v_max.float(), n_fv)
    s_order, s_planes = ordered(s_sum.float(), s_max.float(), n_fs)
    total = v_sum.float().sum(1)
    cost, n_s_all, n_v_all, cov_all = split_search_reference(
        torch.stack([s_planes, v_planes], 1), alpha * total, candidates(n, (n_fs, n_fv), split_candidates), (n_fs, n_fv))
    best = cost.argmin(1, keepdim=True)
    n_s, n_v = n_s_all.gather(1, best), n_v_all.gather(1, best)
    cov = cov_all.gather(1, best).squeeze(1)
    sel_v = torch.zeros(hk, n, dtype=torch.bool).scatter(1, v_order, ar[None] < n_v)
    sel_s = torch.zeros(hk, n, dtype=torch.bool).scatter(1, s_order, ar[None] < n_s)
    covered_lb = torch.where(total > 0, cov / total.clamp(min=1e-30), torch.ones_like(total)).clamp(max=1.0)
    return (*compact(sel_v), *compact(sel_s), covered_lb)


def covered_mass_reference(q_rows, q_pos, k_buffer, token_slots, seq_len, sm_scale, v_idx, v_cnt, s_idx, s_cnt):
    """Exact attention mass of the sampled rows covered by the selected lines, per KV head, as a
    fraction of the total (``G * rows``). Selections are padded ``[Hk, W]`` index tensors + counts."""
    p = _sampled_probs(q_rows, q_pos, k_buffer, token_slots, seq_len, sm_scale)
    hq, r, n = p.shape
    hk = k_buffer.shape[1]
    pg = p.view(hk, hq // hk, r, n).sum(1)
    mask = _line_mask(q_pos.long(), seq_len, v_idx, v_cnt, s_idx, s_cnt)  # [Hk, R, N]
    return (pg * mask).sum((1, 2)) / pg.sum((1, 2))


def _line_mask(q_pos, seq_len, v_idx, v_cnt, s_idx, s_cnt):
    hk = v_idx.shape[0]
    vmask = torch.zeros(hk, seq_len, dtype=torch.bool)
    smask = torch.zeros(hk, seq_len, dtype=torch.bool)
    for h in range(hk):
        vmask[h, v_idx[h, : int(v_cnt[h])].long().cpu()] = True
        smask[h, s_idx[h, : int(s_cnt[h])].long().cpu()] = True
    kpos = torch.arange(seq_len)
    off = q_pos.cpu()[:, None] - kpos[None, :]  # [T, N]
    causal = off >= 0
    on_slash = torch.gather(smask[:, None, :].expand(hk, off.shape[0], seq_len), 2,
                            off.clamp(min=0)[None].expand(hk, -1, -1))
    return causal[None] & (vmask[:, None, :] | on_slash)


def vs_mask_reference(prefix_len: int, seq_len: int, v_idx, v_cnt, s_idx, s_cnt) -> torch.Tensor:
    """``[Hk, seq_len - prefix_len, seq_len]`` bool: query position ``t`` sees key ``k`` iff
    ``k <= t`` and (``k`` is a selected vertical or ``t - k`` a selected slash offset)."""
    return _line_mask(torch.arange(prefix_len, seq_len), seq_len, v_idx, v_cnt, s_idx, s_cnt)


def vs_prefill_reference(q, k_buffer, v_buffer, token_slots, *, prefix_len: int, seq_len: int,
                         v_idx, v_cnt, s_idx, s_cnt, sm_scale: float, mask: torch.Tensor | None = None):
    """Masked attention of the extend tokens ``[prefix_len, seq_len)`` in fp32.

    q ``[T, Hq, D]`` (T = seq_len - prefix_len). Returns ``o [T, Hq, D]`` fp32 and ``lse [T, Hq]``
    base 2 (``log2 sum_k exp(q.k * sm_scale)`` over the masked keys). ``mask`` overrides the line
    mask (``[Hk, T, seq_len]``), e.g. a plain causal mask for the dense comparison.
    """
    t, hq, d = q.shape
    hk = k_buffer.shape[1]
    g = hq // hk
    if mask is None:
        mask = vs_mask_reference(prefix_len, seq_len, v_idx, v_cnt, s_idx, s_cnt)
    k = gather_keys(k_buffer, token_slots, seq_len).repeat_interleave(g, dim=1)
    v = gather_keys(v_buffer, token_slots, seq_len).repeat_interleave(g, dim=1)
    s = torch.einsum("thd,nhd->htn", q.float(), k) * sm_scale
    s = s.masked_fill(~mask.repeat_interleave(g, dim=0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T] natural
    o = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v)
    return o, (lse / torch.log(torch.tensor(2.0))).transpose(0, 1).contiguous()


def decode_topb_reference(q_obs, obs_pos, k_buffer, token_slots, seq_len: int, sm_scale: float, budget: int):
    """Eq. 7 per KV head: score every position ``< seq_len`` by the summed softmax attention of the
    observation queries (``q_obs [n_d, Hq, D]`` at positions ``obs_pos``, causal) over the group's
    query heads; return the sorted top-``min(budget, seq_len)`` positions ``[Hk, B]`` and scores ``[Hk, seq_len]``.
    Ties break toward the lower position."""
    p = _sampled_probs(q_obs, obs_pos, k_buffer, token_slots, seq_len, sm_scale)  # [Hq, R, N]
    hq, r, n = p.shape
    hk = k_buffer.shape[1]
    score = p.view(hk, hq // hk, r, n).sum((1, 2))
    b = min(budget, seq_len)
    # stable descending sort = lower position first among ties
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :b]
    return torch.sort(order, dim=1).values, score


def masked_decode_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, mask, sm_scale):
    """fp32 decode of rows ``q [B, Hq, D]`` over per-(row, KV head) token sets ``mask [B, Hk, N]`` (bool).

    Token ``n`` of row ``b`` lives at slot ``req_to_token[req_pool_indices[b], n]``; ``N`` is the
    longest context of the batch (positions past a row's length must be False). Returns
    ``[B, Hq, D]`` fp32 (a row/head with an empty set gives NaN).
    """
    b, hq, d = q.shape
    hk, n = mask.shape[1], mask.shape[2]
    g = hq // hk
    slots = req_to_token[req_pool_indices.long(), :n].long()       # [B, N]
    k = k_buffer[slots].float()                                     # [B, N, Hk, D]
    v = v_buffer[slots].float()
    s = torch.einsum("bkgd,bnkd->bkgn", q.float().view(b, hk, g, d), k) * sm_scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bkgn,bnkd->bkgd", p, v).reshape(b, hq, d)
