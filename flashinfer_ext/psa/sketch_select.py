"""PSA's one-pass block selection from the key sketch: the top-p block set of every (request, KV head) in one launch.

Supports: the block masses of :func:`flashinfer_ext.psa.key_sketch.sketch_block_mass`
(``[batch, num_kv_heads, group, num_cols]`` base-2 logs), the forced sink / local blocks, a per-request
threshold ``epsilon`` (``>= 1``: every block), a per-(request, KV head) cap on the blocks read and a probe
threshold (what the selection would read at a second epsilon). One program per (request, KV head):

  1. each query head's total approximate mass ``T_g`` (as :func:`~flashinfer_ext.psa.key_sketch.sketch_shares`);
  2. each block's share ``s(b) = max_g (mass_g(b) - T_g)`` (base 2, ``<= 0``), written to ``scores_out`` (``+inf``
     for forced blocks, ``-inf`` past the end) and read back from there by the steps below;
  3. the cut ``tau``: the largest share threshold whose unread rest ``U(tau) = sum_{s < tau} 2^s`` over the
     non-forced blocks is at most ``(1 - epsilon) * 2^-calib_slack`` (so every query head's approximate unread share,
     at most ``U``, keeps ``1 - 2^calib_slack U >= epsilon``), found by :data:`SEARCH_STEPS` bisection steps over
     ``[-SEARCH_FLOOR, 0]`` (a step of ``SEARCH_FLOOR / 2^SEARCH_STEPS`` doublings: the selection reads at most the
     blocks within that factor of the exact top-p set's last share); then raised, by bisection on the count, until
     at most ``cap`` blocks pass (a row at ``epsilon >= 1`` reads every block, whatever its cap);
  4. the blocks with ``s >= tau`` and the forced ones written in block order to ``lists_out``, their count to
     ``list_lens_out``, ``1 - 2^calib_slack U(tau)`` to ``kept_out`` and the probe threshold's count to ``probe_out``.

The attention then reads exactly these lists (:func:`flashinfer_ext.common.split_decode.sparse_decode_split`):
per layer three launches after the sketch pass, where the progressive stop test
(:mod:`flashinfer_ext.psa.wave_merge`) needs a sort, a suffix scan and up to five attention waves with
their merges. The stop point is the sketch's prediction alone (no true block mass enters it).

Cautions: every step is a reduction over the pair's whole row (``tile`` columns at a time), so one program walks
its row ``~2 + SEARCH_STEPS`` times (from L2: the scores it wrote itself, behind a block barrier); the cap search
runs only where the cap binds, the probe search only where the probe threshold differs from the row's. A cap
between two equal shares reads fewer blocks than the cap. No allocation, no host sync: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .key_sketch import head_totals

__all__ = ["sketch_select", "sketch_select_reference", "SEARCH_STEPS", "SEARCH_FLOOR"]

SEARCH_STEPS = 11
SEARCH_FLOOR = 40.0  # doublings below the total: 2^-40 of a head's mass per block is never worth reading


@triton.jit
def _row_stats(s_row, num_cols, tau, TILE: tl.constexpr):
    """Over the non-forced blocks of a row of shares: ``(sum of 2^s for s < tau, count of s >= tau)``."""
    u = tl.zeros([TILE], tl.float32)
    n = tl.zeros([TILE], tl.int32)
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        s = tl.load(s_row + b, mask=b < num_cols, other=float("-inf"))
        ranked = s < float("inf")  # forced blocks are +inf, blocks past the end -inf (weight 0, never counted)
        u += tl.where(ranked & (s < tau), tl.exp2(s), 0.0)
        n += (ranked & (s >= tau) & (s > float("-inf"))).to(tl.int32)
    return tl.sum(u, axis=0), tl.sum(n, axis=0)


@triton.jit
def _bisect(s_row, num_cols, lo, hi, budget, cap, BY_COUNT: tl.constexpr, STEPS: tl.constexpr, TILE: tl.constexpr):
    """``STEPS`` bisection steps of ``[lo, hi]``: ``lo`` rises while ``U(mid) <= budget`` (``BY_COUNT`` False) or
    while more than ``cap`` blocks pass ``mid`` (``BY_COUNT`` True), else ``hi`` falls. Returns ``(lo, hi)``."""
    for _ in range(STEPS):
        mid = 0.5 * (lo + hi)
        u_mid, n_mid = _row_stats(s_row, num_cols, mid, TILE)
        if BY_COUNT:
            up = n_mid > cap
        else:
            up = u_mid <= budget
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid)
    return lo, hi


@triton.jit
def _search(s_row, num_cols, budget, cap, total_u, STEPS: tl.constexpr, FLOOR: tl.constexpr, TILE: tl.constexpr):
    """The cut of step 3: the largest ``tau`` on the bisection grid with ``U(tau) <= budget``, then raised until at
    most ``cap`` blocks pass. Returns ``(tau, U(tau), blocks passing)``."""
    zero = tl.full([], 0.0, tl.float32)
    lo = tl.full([], -FLOOR, tl.float32)
    if total_u <= budget:  # nothing needs reading
        lo = tl.full([], float("inf"), tl.float32)
    else:
        lo, _hi = _bisect(s_row, num_cols, lo, zero, budget, cap, False, STEPS, TILE)
    u, n = _row_stats(s_row, num_cols, lo, TILE)
    if n > cap:  # the cap binds: the lowest grid threshold in (lo, 0] with at most cap blocks
        _lo, lo = _bisect(s_row, num_cols, lo, zero, budget, cap, True, STEPS, TILE)
        u, n = _row_stats(s_row, num_cols, lo, TILE)
        if n > cap:  # every share at or above 0: nothing fits
            lo = tl.full([], float("inf"), tl.float32)
            u = total_u
            n = n * 0
    return lo, u, n


@triton.jit
def _select_kernel(
    mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr, eps_ptr, probe_eps_ptr, caps_ptr, probe_caps_ptr,
    scores_ptr, stride_sb, stride_sh, lists_ptr, stride_lb, stride_lh, list_lens_ptr, probe_ptr, kept_ptr, tot_ptr,
    num_cols, sink_blocks, local_blocks, slack_factor,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, STEPS: tl.constexpr, FLOOR: tl.constexpr,
):
    # 1. each query head's total (base-2 log-sum over every block)
    pair, r64, h, n_blocks, g, gmask, m_row, tot_s = head_totals(
        mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr, tot_ptr, num_cols, NUM_KV_HEADS, GROUP, G_PAD,
        BLOCK_SIZE, TILE)
    r = r64.to(tl.int32)
    # 2. the shares, the forced blocks and the whole ranked mass
    s_row = scores_ptr + r64 * stride_sb + h * stride_sh
    n_forced = tl.zeros([TILE], tl.int32)
    all_u = tl.zeros([TILE], tl.float32)
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
        s = tl.max(x - tot_s[:, None], axis=0)
        valid = b < n_blocks
        forced = valid & ((b < sink_blocks) | (b >= n_blocks - local_blocks))
        n_forced += forced.to(tl.int32)
        all_u += tl.where(valid & (forced == 0), tl.exp2(s), 0.0)
        tl.store(s_row + b, tl.where(forced, float("inf"), tl.where(valid, s, float("-inf"))), mask=b < num_cols)
    nf = tl.sum(n_forced, axis=0)
    total_u = tl.sum(all_u, axis=0)
    tl.debug_barrier()  # the row's shares, written above by every thread of the program, are read back below
    # 3. the cut (every block at epsilon >= 1)
    eps = tl.load(eps_ptr + r)
    cap = tl.maximum(tl.load(caps_ptr + pair) - nf, 0)
    if eps >= 1.0:  # every block, whatever the cap
        tau = tl.full([], float("-inf"), tl.float32)
        u = tl.full([], 0.0, tl.float32)
        n_sel = tl.maximum(n_blocks - nf, 0)
    else:
        tau, u, n_sel = _search(s_row, num_cols, (1.0 - eps) / slack_factor, cap, total_u, STEPS, FLOOR, TILE)
    total = nf + n_sel
    tl.store(list_lens_ptr + pair, total)
    tl.store(kept_ptr + pair, tl.minimum(tl.maximum(1.0 - slack_factor * u, 0.0), 1.0))
    # probe: the same search at the probe threshold and cap (the selection's own count where they are the row's)
    p_eps = tl.load(probe_eps_ptr + r)
    p_cap = tl.maximum(tl.load(probe_caps_ptr + r) - nf, 0)
    p_total = total
    if (p_eps != eps) | (p_cap != cap):
        if p_eps >= 1.0:
            p_total = nf + tl.maximum(n_blocks - nf, 0)
        else:
            _t, _u, p_n = _search(s_row, num_cols, (1.0 - p_eps) / slack_factor, p_cap, total_u, STEPS, FLOOR, TILE)
            p_total = nf + p_n
    tl.store(probe_ptr + pair, tl.minimum(p_total, total))
    # 4. the selected ids in block order
    l_row = lists_ptr + r64 * stride_lb + h * stride_lh
    base = tl.full([], 0, tl.int32)
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        s = tl.load(s_row + b, mask=b < num_cols, other=float("-inf"))
        sel = (b < n_blocks) & (s >= tau)
        si = sel.to(tl.int32)
        pos = base + tl.cumsum(si, 0) - si
        tl.store(l_row + pos, b.to(l_row.dtype.element_ty), mask=sel)
        base += tl.sum(si, axis=0)


def sketch_select(mass: torch.Tensor, seq_lens: torch.Tensor, epsilon: torch.Tensor, caps: torch.Tensor,
                  probe_epsilon: torch.Tensor, probe_caps: torch.Tensor, *, scores_out: torch.Tensor,
                  lists_out: torch.Tensor, list_lens_out: torch.Tensor, probe_out: torch.Tensor,
                  kept_out: torch.Tensor, totals_out: torch.Tensor, block_size: int, sink_blocks: int,
                  local_blocks: int, calib_slack: float, tile: int = 2048) -> None:
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
      tile: columns per step of a row walk (a 32k context at 16-token blocks is one step).
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
        TILE=(t := min(tile, triton.next_power_of_2(max(num_cols, 16)))), STEPS=SEARCH_STEPS, FLOOR=SEARCH_FLOOR,
        num_warps=8 if t >= 1024 else 4,
    )


def _row_stats_reference(s: torch.Tensor, ranked: torch.Tensor, tau: float) -> tuple[float, int]:
    below = ranked & (s < tau)
    return float(torch.exp2(s[below].double()).sum()), int((ranked & (s >= tau) & (s > float("-inf"))).sum())


def _bisect_reference(lo: float, hi: float, raise_lo) -> tuple[float, float]:
    """:data:`SEARCH_STEPS` bisection steps on the kernel's fp32 midpoints: ``raise_lo(mid)`` moves ``lo`` up, else
    ``hi`` down."""
    for _ in range(SEARCH_STEPS):
        mid = float((torch.tensor(lo, dtype=torch.float32) + torch.tensor(hi, dtype=torch.float32)) * 0.5)
        lo, hi = (mid, hi) if raise_lo(mid) else (lo, mid)
    return lo, hi


def _search_reference(s, ranked, budget, cap, total_u):
    """:func:`_search` on the CPU: the same bisection grid."""
    lo = float("inf") if total_u <= budget else _bisect_reference(
        -SEARCH_FLOOR, 0.0, lambda mid: _row_stats_reference(s, ranked, mid)[0] <= budget)[0]
    u, n = _row_stats_reference(s, ranked, lo)
    if n > cap:
        lo = _bisect_reference(lo, 0.0, lambda mid: _row_stats_reference(s, ranked, mid)[1] > cap)[1]
        u, n = _row_stats_reference(s, ranked, lo)
        if n > cap:
            lo, u, n = float("inf"), total_u, 0
    return lo, u, n


def sketch_select_reference(mass: torch.Tensor, seq_lens, epsilon, caps, *, block_size: int, sink_blocks: int,
                            local_blocks: int, calib_slack: float) -> tuple[list, torch.Tensor]:
    """CPU reference of :func:`sketch_select`'s selection (fp32 shares, fp64 sums, the kernel's bisection grid).

    ``mass`` ``[batch, num_kv_heads, group, num_cols]``; ``epsilon`` a ``[batch]`` sequence; ``caps``
    ``[batch, num_kv_heads]``. Returns ``(lists, kept)``: ``lists[r][h]`` the selected block ids (block order)
    and ``kept`` ``[batch, num_kv_heads]`` fp32.
    """
    batch, num_kv_heads, _, num_cols = mass.shape
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
            if eps >= 1.0:
                sel, u = torch.ones(n_blocks, dtype=torch.bool), 0.0
            else:
                total_u = float(torch.exp2(s[ranked].double()).sum())
                cap = max(int(caps[r, h]) - int(forced.sum()), 0)
                tau, u, _ = _search_reference(s, ranked, (1.0 - eps) / slack, cap, total_u)
                sel = forced | (s >= tau)
            kept[r, h] = min(max(1.0 - slack * u, 0.0), 1.0)
            row.append(torch.nonzero(sel).flatten().tolist())
        lists.append(row)
    return lists, kept
