"""PSA's one-pass block selection from the key sketch: the top-p block set of every (request, KV head) in one launch.

Supports: the block masses of :func:`flashinfer_ext.psa.key_sketch.sketch_block_mass`
(``[batch, num_kv_heads, group, num_cols]`` base-2 logs), the forced sink / local blocks, a per-request
threshold ``epsilon`` (``>= 1``: every block), a per-(request, KV head) cap on the blocks read and a probe
threshold (what the selection would read at a second epsilon). One program per (request, KV head):

  1. each query head's total approximate mass ``T_g`` (as :func:`~flashinfer_ext.psa.key_sketch.sketch_shares`);
  2. each block's share ``s(b) = max_g (mass_g(b) - T_g)`` (base 2, ``<= 0``), written to ``scores_out``, and a
     histogram of the non-forced blocks' ``2^s`` and counts over :data:`COARSE_BINS` bins of
     ``1 / BINS_PER_LOG2`` in ``-s`` (the last bin takes every smaller share);
  3. the cut: the fewest top bins whose unread rest ``U = sum 2^s`` over the bins below is at most
     ``(1 - epsilon) * 2^-calib_slack`` (so every query head's approximate unread share, at most ``U``, keeps
     ``1 - 2^calib_slack U >= epsilon``), lowered to fit the cap; the cut bin is then split into
     :data:`FINE_BINS` finer bins and cut the same way (at most one fine bin, 1/512 of a doubling, past the
     exact top-p set);
  4. the selected block ids written in block order to ``lists_out`` (forced blocks included), their count to
     ``list_lens_out``, ``1 - 2^calib_slack U`` to ``kept_out`` and the probe threshold's count to ``probe_out``.

The attention then reads exactly these lists (:func:`flashinfer_ext.common.split_decode.sparse_decode_split`):
per layer three launches after the sketch pass, where the progressive stop test
(:mod:`flashinfer_ext.psa.wave_merge`) needs a sort, a suffix scan and up to five attention waves with
their merges. The stop point is the sketch's prediction alone (no true block mass enters it).

Cautions: the selection equals the top blocks of the sketch's rank order up to ties inside one fine bin
(then the whole fine bin is read); a cap that cuts inside a coarse bin reads only the bins above it (fewer
blocks than the cap). The probe count uses the coarse cut (at most one coarse bin more than the exact count),
or the selection's own count where the probe threshold and cap equal the row's. No allocation, no host sync:
graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sketch_select", "sketch_select_reference", "COARSE_BINS", "FINE_BINS", "BINS_PER_LOG2"]

COARSE_BINS = 64
FINE_BINS = 64
BINS_PER_LOG2 = 2  # coarse bins of half a doubling: 64 bins reach shares of 2^-32


@triton.jit
def _shares_tile(m_row, b, n_blocks, tot_s, gmask, sink_blocks, local_blocks):
    """Shares ``[TILE]`` of blocks ``b`` (``-inf`` past the end) and their forced / valid masks."""
    x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
    s = tl.max(x - tot_s[:, None], axis=0)
    valid = b < n_blocks
    forced = valid & ((b < sink_blocks) | (b >= n_blocks - local_blocks))
    return s, forced, valid


@triton.jit
def _coarse_bin(s, NB: tl.constexpr, BPL: tl.constexpr):
    return tl.minimum(tl.maximum(-s * BPL, 0.0), NB - 1.0).to(tl.int32)


@triton.jit
def _cut(hist, cnt, budget, cap, allow_all, NB: tl.constexpr):
    """Bins ``[0, k)`` to read: the fewest whose rest ``<= budget``, lowered to fit ``cap`` blocks; ``NB`` when
    ``allow_all``. Returns ``(k, rest: the sum of bins >= k, blocks in bins [0, k), whether the cap lowered k)``."""
    kb = tl.arange(0, NB)
    tail = tl.cumsum(hist, 0, reverse=True)  # tail[k] = sum of bins >= k
    k_mass = tl.sum((tail > budget).to(tl.int32), axis=0)
    ccnt = tl.cumsum(cnt, 0)  # blocks in bins <= k
    k_cap = tl.sum((ccnt <= cap).to(tl.int32), axis=0)
    k = tl.where(allow_all, NB, tl.minimum(k_mass, k_cap))
    rest = tl.sum(tl.where(kb == k, tail, 0.0), axis=0)
    return k, rest, tl.sum(tl.where(kb < k, cnt, 0), axis=0), (k_cap < k_mass) & (allow_all == 0)


@triton.jit
def _select_kernel(
    mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr, eps_ptr, probe_eps_ptr, caps_ptr, probe_caps_ptr,
    scores_ptr, stride_sb, stride_sh, lists_ptr, stride_lb, stride_lh, list_lens_ptr, probe_ptr, kept_ptr, tot_ptr,
    num_cols, sink_blocks, local_blocks, slack_factor,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, NB: tl.constexpr, NF: tl.constexpr, BPL: tl.constexpr,
):
    pair = tl.program_id(0)
    r = pair // NUM_KV_HEADS
    h = pair % NUM_KV_HEADS
    r64 = r.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    n_blocks = tl.minimum((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, num_cols)
    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    m_row = mass_ptr + r64 * stride_mb + h * stride_mh + g[:, None] * stride_mg
    # 1. each query head's total (base-2 log-sum over every block)
    run_m = tl.full([G_PAD], float("-inf"), tl.float32)
    run_s = tl.zeros([G_PAD], tl.float32)
    for c0 in range(0, n_blocks, TILE):
        b = c0 + tl.arange(0, TILE)
        x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
        new_m = tl.maximum(run_m, tl.max(x, axis=1))
        nms = tl.where(new_m == float("-inf"), 0.0, new_m)
        run_s = run_s * tl.exp2(run_m - nms) + tl.sum(tl.exp2(x - nms[:, None]), axis=1)
        run_m = new_m
    tot = tl.where(run_s > 0.0, tl.log2(tl.maximum(run_s, 1e-30)) + tl.where(run_m == float("-inf"), 0.0, run_m),
                   float("-inf"))
    tl.store(tot_ptr + pair.to(tl.int64) * GROUP + g, tot, mask=gmask)
    tot_s = tl.where(tot == float("-inf"), 0.0, tot)
    # 2. shares, and the coarse histogram of the non-forced blocks
    kb = tl.arange(0, NB)
    hist = tl.zeros([NB], tl.float32)
    cnt = tl.zeros([NB], tl.int32)
    n_forced = tl.full([], 0, tl.int32)
    s_row = scores_ptr + r64 * stride_sb + h * stride_sh
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        s, forced, valid = _shares_tile(m_row, b, n_blocks, tot_s, gmask, sink_blocks, local_blocks)
        ranked = valid & (forced == 0)
        hit = (_coarse_bin(s, NB, BPL)[None, :] == kb[:, None]) & ranked[None, :]  # [NB, TILE]
        hist += tl.sum(tl.where(hit, tl.exp2(s)[None, :], 0.0), axis=1)
        cnt += tl.sum(hit.to(tl.int32), axis=1)
        n_forced += tl.sum(forced.to(tl.int32), axis=0)
        tl.store(s_row + b, tl.where(forced, float("inf"), tl.where(valid, s, float("-inf"))), mask=b < num_cols)
    # 3. the coarse cut, then the cut bin split finer
    eps = tl.load(eps_ptr + r)
    cap = tl.maximum(tl.load(caps_ptr + pair) - n_forced, 0)
    budget = (1.0 - eps) / slack_factor
    k, rest, n_sel, capped = _cut(hist, cnt, budget, cap, eps >= 1.0, NB)
    fine_k = tl.full([], NF, tl.int32)  # fine bins of the cut bin k - 1 to read (all unless refined)
    refine = (k > 0) & (k < NB) & (capped == 0)
    kc = k - 1
    bin_rest = rest  # rest below the cut bin
    if refine:
        kf = tl.arange(0, NF)
        fh = tl.zeros([NF], tl.float32)
        fc = tl.zeros([NF], tl.int32)
        for c0 in range(0, num_cols, TILE):
            b = c0 + tl.arange(0, TILE)
            s, forced, valid = _shares_tile(m_row, b, n_blocks, tot_s, gmask, sink_blocks, local_blocks)
            in_bin = valid & (forced == 0) & (_coarse_bin(s, NB, BPL) == kc)
            fpos = tl.minimum(tl.maximum((-s * BPL - kc) * NF, 0.0), NF - 1.0).to(tl.int32)
            hit = (fpos[None, :] == kf[:, None]) & in_bin[None, :]
            fh += tl.sum(tl.where(hit, tl.exp2(s)[None, :], 0.0), axis=1)
            fc += tl.sum(hit.to(tl.int32), axis=1)
        fk, _, _, _ = _cut(fh, fc, budget - bin_rest, n_blocks, eps > 2.0, NF)  # never all
        fine_k = tl.maximum(fk, 1)  # the coarse cut needed bin kc: read at least its first fine bin
        rest = bin_rest + tl.sum(tl.where(kf >= fine_k, fh, 0.0), axis=0)
        n_sel = n_sel - tl.sum(tl.where(kf >= fine_k, fc, 0), axis=0)
    total = n_forced + n_sel
    tl.store(list_lens_ptr + pair, total)
    tl.store(kept_ptr + pair, tl.minimum(tl.maximum(1.0 - slack_factor * rest, 0.0), 1.0))
    # probe: the coarse cut at the probe threshold (the selection's own count at the row's threshold and cap)
    p_eps = tl.load(probe_eps_ptr + r)
    p_cap = tl.maximum(tl.load(probe_caps_ptr + r) - n_forced, 0)
    _, _, p_sel, _ = _cut(hist, cnt, (1.0 - p_eps) / slack_factor, p_cap, p_eps >= 1.0, NB)
    same = (p_eps == eps) & (p_cap == cap)
    tl.store(probe_ptr + pair, tl.where(same, total, tl.minimum(n_forced + p_sel, total)))
    # 4. the selected ids in block order
    l_row = lists_ptr + r64 * stride_lb + h * stride_lh
    base = tl.full([], 0, tl.int32)
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        s, forced, valid = _shares_tile(m_row, b, n_blocks, tot_s, gmask, sink_blocks, local_blocks)
        cb = _coarse_bin(s, NB, BPL)
        fpos = tl.minimum(tl.maximum((-s * BPL - kc) * NF, 0.0), NF - 1.0).to(tl.int32)
        sel = valid & (forced | (cb < kc) | ((cb == kc) & (fpos < fine_k)))
        si = sel.to(tl.int32)
        pos = base + tl.cumsum(si, 0) - si
        tl.store(l_row + pos, b.to(l_row.dtype.element_ty), mask=sel)
        base += tl.sum(si, axis=0)


def sketch_select(mass: torch.Tensor, seq_lens: torch.Tensor, epsilon: torch.Tensor, caps: torch.Tensor,
                  probe_epsilon: torch.Tensor, probe_caps: torch.Tensor, *, scores_out: torch.Tensor,
                  lists_out: torch.Tensor, list_lens_out: torch.Tensor, probe_out: torch.Tensor,
                  kept_out: torch.Tensor, totals_out: torch.Tensor, block_size: int, sink_blocks: int,
                  local_blocks: int, calib_slack: float, tile: int = 256) -> None:
    """Select each (request, KV head)'s blocks from the sketch's masses (one launch, ``batch * num_kv_heads`` programs).

    Args:
      mass: ``[batch, num_kv_heads, group, num_cols]`` fp32 (last dim contiguous) from ``sketch_block_mass``.
      seq_lens: ``[batch]`` int32; epsilon, probe_epsilon: ``[batch]`` fp32 (``>= 1``: every block).
      caps: ``[batch, num_kv_heads]`` int32 (contiguous) most blocks a pair may read, forced ones included;
        probe_caps: ``[batch]`` int32, the same at the probe threshold.
      scores_out: ``[batch, num_kv_heads, num_cols]`` fp32 (last dim contiguous): the shares (``+inf`` forced,
        ``-inf`` past the end).
      lists_out: ``[batch, num_kv_heads, >= num_cols]`` int32 or int64 (last dim contiguous): selected ids in
        block order; list_lens_out, probe_out: ``[batch, num_kv_heads]`` int32 (contiguous); kept_out the same in
        fp32 (``1 - 2^calib_slack U``); totals_out ``[batch * num_kv_heads * group]`` fp32 (``T_g``).
    """
    batch, num_kv_heads, group, num_cols = mass.shape
    if batch == 0 or num_cols == 0:
        return
    assert mass.stride(3) == 1 and scores_out.stride(2) == 1 and lists_out.stride(2) == 1
    assert caps.is_contiguous() and list_lens_out.is_contiguous() and probe_out.is_contiguous()
    assert kept_out.is_contiguous() and totals_out.is_contiguous()
    _select_kernel[(batch * num_kv_heads,)](
        mass, mass.stride(0), mass.stride(1), mass.stride(2), seq_lens, epsilon, probe_epsilon, caps, probe_caps,
        scores_out, scores_out.stride(0), scores_out.stride(1), lists_out, lists_out.stride(0), lists_out.stride(1),
        list_lens_out, probe_out, kept_out, totals_out,
        num_cols, sink_blocks, local_blocks, float(2.0 ** calib_slack),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size,
        TILE=min(tile, triton.next_power_of_2(max(num_cols, 16))), NB=COARSE_BINS, NF=FINE_BINS,
        BPL=BINS_PER_LOG2, num_warps=4,
    )


def _cut_reference(hist: torch.Tensor, cnt: torch.Tensor, budget: float, cap: int, allow_all: bool):
    nb = hist.numel()
    tail = torch.flip(torch.cumsum(torch.flip(hist.double(), [0]), 0), [0])
    k_mass = int((tail > budget).sum())
    k_cap = int((torch.cumsum(cnt, 0) <= cap).sum())
    k = nb if allow_all else min(k_mass, k_cap)
    rest = float(tail[k]) if k < nb else 0.0
    return k, rest, int(cnt[:k].sum()), k_cap < k_mass and not allow_all


def sketch_select_reference(mass: torch.Tensor, seq_lens, epsilon, caps, *, block_size: int, sink_blocks: int,
                            local_blocks: int, calib_slack: float) -> tuple[list, torch.Tensor]:
    """fp64 reference of :func:`sketch_select`'s selection on the CPU.

    ``mass`` ``[batch, num_kv_heads, group, num_cols]``; ``epsilon`` a ``[batch]`` sequence; ``caps``
    ``[batch, num_kv_heads]``. Returns ``(lists, kept)``: ``lists[r][h]`` the selected block ids (block order)
    and ``kept`` ``[batch, num_kv_heads]`` fp32.
    """
    batch, num_kv_heads, _, num_cols = mass.shape
    nb, nf, bpl = COARSE_BINS, FINE_BINS, BINS_PER_LOG2
    slack = 2.0 ** calib_slack
    lists, kept = [], torch.ones(batch, num_kv_heads)
    for r in range(batch):
        n_blocks = min(-(-int(seq_lens[r]) // block_size), num_cols)
        eps = float(epsilon[r])
        row = []
        for h in range(num_kv_heads):
            m = mass[r, h, :, :n_blocks].float()
            tot = torch.logsumexp(m * 0.6931471805599453, -1) / 0.6931471805599453
            tot = torch.where(torch.isfinite(tot), tot, torch.zeros_like(tot))
            s = (m - tot[:, None]).amax(0)
            b = torch.arange(n_blocks)
            forced = (b < sink_blocks) | (b >= n_blocks - local_blocks)
            ranked = ~forced
            cb = torch.clamp(-s * bpl, 0, nb - 1).floor().long()
            w = torch.exp2(s.double())
            hist = torch.zeros(nb, dtype=torch.float64).index_add_(0, cb[ranked], w[ranked])
            cnt = torch.zeros(nb, dtype=torch.long).index_add_(0, cb[ranked], torch.ones_like(cb[ranked]))
            cap = max(int(caps[r, h]) - int(forced.sum()), 0)
            budget = (1.0 - eps) / slack
            k, rest, _, capped = _cut_reference(hist, cnt, budget, cap, eps >= 1.0)
            sel = forced | (cb < k)
            if 0 < k < nb and not capped:
                kc = k - 1
                fpos = torch.clamp((-s * bpl - kc) * nf, 0, nf - 1).floor().long()
                in_bin = ranked & (cb == kc)
                fh = torch.zeros(nf, dtype=torch.float64).index_add_(0, fpos[in_bin], w[in_bin])
                fc = torch.zeros(nf, dtype=torch.long).index_add_(0, fpos[in_bin], torch.ones_like(fpos[in_bin]))
                fk = _cut_reference(fh, fc, budget - rest, n_blocks, False)[0]
                fk = max(fk, 1)
                rest = rest + float(fh[fk:].sum())
                sel = forced | (cb < kc) | ((cb == kc) & (fpos < fk))
            kept[r, h] = min(max(1.0 - slack * rest, 0.0), 1.0)
            row.append(torch.nonzero(sel).flatten().tolist())
        lists.append(row)
    return lists, kept
