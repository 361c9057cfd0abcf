"""PSA decode, wave merge: fold one wave's chunk partials in rank order, stop test chunk by chunk.

Supports: the partials of :func:`flashinfer_ext.psa.chunks.psa_chunk_attention` (normalised
``o``, base-2 ``lse``, AS_min and bound tightness per chunk and query head). One program per
(request, KV head) walks the wave's chunks in tiles of ``TC`` and, after every chunk ``j``
(chunk 0 = forced blocks, no test), evaluates per query head

    P = AS_acc / (AS_acc + R),   stop when P >= epsilon[request] for every head of the group,

with ``R`` from the configured estimator:

  * ``paper``:      R = AS_min * N_left                         (PSA Alg. 1, line 15)
  * ``bound``:      R = U(e) = sum_{rank >= e} block_size * 2^(scale * cuboid score)   (true bound)
  * ``calibrated``: R = U(e) * 2^min(0, delta + calib_slack), delta = max over the ranked blocks
                    read so far of log2(true block mass / its bound) (bound used as is while no
                    ranked block was read)
  * ``mean``:       R = U(e) * 2^(delta + calib_slack) with the scores = group max of q . mean key
                    (an estimate, not a bound; delta as above, 0 while none)
  * ``sketch``:     R_g = 2^(T_g + calib_slack) * sum_{rank >= e} 2^share, the shares and each query head's
                    total T_g from the int4 key sketch (:mod:`flashinfer_ext.psa.key_sketch`; an estimate)

(``e`` = ranks read, ``U`` from :func:`flashinfer_ext.psa.criticality.bound_suffix``). A pair also
stops at the end of its list (``N_left == 0`` or the ``max_blocks`` cap; a row with
``epsilon >= 1`` only stops there).

Probe: the same test with a second threshold ``probe_epsilon[request]`` and list cap
``probe_lens[request]`` records ``probe_nread``, the ranks the pair would have read had it run at
that threshold (at most ``nread``: the probe also stops where the pair stops). A row run at
``epsilon`` 1.0 (the exact result) with its real threshold as ``probe_epsilon`` reports, in one pass,
what PSA would read at that threshold; for a row run at its own threshold ``probe_nread == nread``.

The running state (fp32 ``o`` and base-2 ``lse``, AS_min,
delta, ranks read, done flag) lives in device buffers between waves; every merge also writes
the outputs ``o`` / ``lse`` / ``nread`` / ``kept_est`` of the pairs it touched, so after the last
wave they are final. No host sync, no allocation; graph-capturable.

Cautions: the log-space cumulative sums are fp32; ``kept_est`` is the smallest P over the
group's heads at the stop point (1.0 when nothing is left unread).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["wave_merge", "ESTIMATOR_IDS"]

ESTIMATOR_IDS = {"paper": 0, "bound": 1, "calibrated": 2, "mean": 3, "sketch": 4}


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _wave_merge_kernel(
    po_ptr, plse_ptr, pmin_ptr, pdmax_ptr, wmax,
    seq_lens_ptr, list_lens_ptr, n_forced_ptr, ends_ptr, eps_ptr, sfx_ptr, stride_sb, stride_sh,
    st_acc_ptr, st_lse_ptr, st_min_ptr, st_dmax_ptr, done_ptr, nread_ptr, kept_ptr,
    probe_eps_ptr, probe_lens_ptr, probe_nread_ptr, tot_ptr,
    o_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    chunk0, n_chunks, calib_slack,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TC: tl.constexpr, FIRST: tl.constexpr,
    ESTIMATOR: tl.constexpr,
):
    pair = tl.program_id(0)
    r = pair // NUM_KV_HEADS
    h = pair % NUM_KV_HEADS
    r64 = r.to(tl.int64)
    p64 = pair.to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    gd_mask = gmask[:, None] & dmask[None, :]
    st_off = (p64 * GROUP + g)[:, None] * HEAD_DIM + d[None, :]

    seq_len = tl.load(seq_lens_ptr + r)
    n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    list_len = tl.load(list_lens_ptr + pair)
    nf = tl.minimum(tl.load(n_forced_ptr + r), list_len)
    eps = tl.load(eps_ptr + r)
    progressive = eps < 1.0
    log2_eps = tl.log2(tl.minimum(eps, 1.0))
    log2_1m_eps = tl.log2(tl.maximum(1.0 - eps, 1e-30))  # the test is off when eps >= 1
    p_eps = tl.load(probe_eps_ptr + r)
    p_progressive = p_eps < 1.0
    p_log2_eps = tl.log2(tl.minimum(p_eps, 1.0))
    p_log2_1m_eps = tl.log2(tl.maximum(1.0 - p_eps, 1e-30))
    p_len = tl.minimum(tl.load(probe_lens_ptr + r), list_len)
    if FIRST:
        fin = pair * 0
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        run_lse = tl.full([G_PAD], float("-inf"), tl.float32)
        run_min = tl.full([G_PAD], float("inf"), tl.float32)
        run_dmax = tl.full([G_PAD], float("-inf"), tl.float32)
        cur = pair * 0
        kept = (pair * 0).to(tl.float32) + 1.0
        p_nread = pair * 0 - 1  # -1: the probe has not stopped yet
    else:
        fin = tl.load(done_ptr + pair)
        acc = tl.load(st_acc_ptr + st_off, mask=gd_mask, other=0.0)
        run_lse = tl.load(st_lse_ptr + p64 * GROUP + g, mask=gmask, other=float("-inf"))
        run_min = tl.load(st_min_ptr + p64 * GROUP + g, mask=gmask, other=float("inf"))
        run_dmax = tl.load(st_dmax_ptr + p64 * GROUP + g, mask=gmask, other=float("-inf"))
        cur = tl.load(nread_ptr + pair)
        kept = tl.load(kept_ptr + pair)
        p_nread = tl.load(probe_nread_ptr + pair)
    active = fin == 0

    c0 = 0
    while (c0 < n_chunks) & (fin == 0):
        c = c0 + tl.arange(0, TC)
        cvalid = c < n_chunks
        jj = chunk0 + c
        e_prev = tl.load(ends_ptr + tl.maximum(jj - 1, 0), mask=cvalid, other=0)
        lo = tl.where(jj == 0, 0, nf + e_prev)
        hi = tl.minimum(nf + tl.load(ends_ptr + jj, mask=cvalid, other=0), list_len)
        real = cvalid & (lo < hi)
        poff = (p64 * wmax + c)[:, None] * GROUP + g[None, :]
        pm = real[:, None] & gmask[None, :]
        lse_c = tl.load(plse_ptr + poff, mask=pm, other=float("-inf"))  # [TC, G_PAD]
        min_c = tl.load(pmin_ptr + poff, mask=pm, other=float("inf"))
        dmx_c = tl.load(pdmax_ptr + poff, mask=pm, other=float("-inf"))
        # cumulative AS_acc (log2), AS_min and delta after each chunk of the tile
        mx = tl.maximum(tl.max(lse_c, axis=0), run_lse)
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        cs = tl.cumsum(tl.exp2(lse_c - mxs[None, :]), axis=0) + tl.exp2(run_lse - mxs)[None, :]
        cum_lse = tl.log2(cs) + mxs[None, :]
        cum_min = tl.minimum(tl.associative_scan(min_c, 0, _min_fn), run_min[None, :])
        cum_dmax = tl.maximum(tl.associative_scan(dmx_c, 0, _max_fn), run_dmax[None, :])
        n_left = n_blocks - hi
        if ESTIMATOR == 0:
            rem = cum_min + tl.log2(tl.maximum(n_left, 1).to(tl.float32))[:, None]
        else:
            sfx = tl.load(sfx_ptr + r64 * stride_sb + h * stride_sh + hi, mask=real, other=float("-inf"))
            rem = sfx[:, None] + tl.zeros([TC, G_PAD], tl.float32)
            if ESTIMATOR == 2:
                corr = tl.where(cum_dmax == float("-inf"), 0.0, tl.minimum(cum_dmax + calib_slack, 0.0))
                rem = rem + corr
            if ESTIMATOR == 3:  # 'mean': an estimate raised by the largest gap seen, not clamped
                corr = tl.where(cum_dmax == float("-inf"), 0.0, cum_dmax) + calib_slack
                rem = rem + corr
            if ESTIMATOR == 4:  # 'sketch': the shares' suffix times each query head's approximate total
                tot = tl.load(tot_ptr + p64 * GROUP + g, mask=gmask, other=0.0)
                rem = rem + (tot + calib_slack)[None, :]
        rem = tl.where((n_left <= 0)[:, None], float("-inf"), rem)
        ok = (cum_lse + log2_1m_eps >= log2_eps + rem) | (g >= GROUP)[None, :]
        all_ok = tl.min(ok.to(tl.int32), axis=1) > 0
        test_c = (jj >= 1).to(tl.int32) * all_ok.to(tl.int32) * progressive.to(tl.int32)
        stop_c = real & ((test_c > 0) | (hi >= list_len) | (n_left <= 0))
        first = tl.min(tl.where(stop_c, c, 1 << 30), axis=0)
        inc = real & (c <= first)
        # the probe: the same test at probe_epsilon, capped at probe_lens; it stops no later than the pair
        p_ok = (cum_lse + p_log2_1m_eps >= p_log2_eps + rem) | (g >= GROUP)[None, :]
        p_all = tl.min(p_ok.to(tl.int32), axis=1) > 0
        p_test = (jj >= 1).to(tl.int32) * p_all.to(tl.int32) * p_progressive.to(tl.int32)
        p_stop = real & ((p_test > 0) | (hi >= p_len) | (n_left <= 0) | (c == first))
        p_first = tl.min(tl.where(p_stop, c, 1 << 30), axis=0)
        p_hi = tl.minimum(tl.max(tl.where(real & (c == p_first), hi, 0), axis=0), p_len)
        p_nread = tl.where((p_nread < 0) & (p_first < (1 << 30)), p_hi, p_nread)
        # estimator value at the last included chunk (min over the group's heads)
        last = tl.max(tl.where(inc, c, -1), axis=0)
        rmx = tl.maximum(cum_lse, rem)
        rmxs = tl.where(rmx == float("-inf"), 0.0, rmx)
        p_est = tl.exp2(cum_lse - rmxs) / (tl.exp2(cum_lse - rmxs) + tl.exp2(rem - rmxs))
        p_est = tl.where((cum_lse == float("-inf")) | (rem == float("inf")), 0.0, p_est)
        p_est = tl.min(tl.where(gmask[None, :], p_est, 1.0), axis=1)  # [TC]
        kept = tl.where(last >= 0, tl.sum(tl.where(c == last, p_est, 0.0), axis=0), kept)
        # fold the included chunks into the running state
        w_c = tl.where(inc[:, None], tl.exp2(lse_c - mxs[None, :]), 0.0)
        new_lse = tl.log2(tl.exp2(run_lse - mxs) + tl.sum(w_c, axis=0)) + mxs
        nls = tl.where(new_lse == float("-inf"), 0.0, new_lse)
        w_c = tl.where(inc[:, None], tl.exp2(lse_c - nls[None, :]), 0.0)
        o_c = tl.load(po_ptr + poff[:, :, None] * HEAD_DIM + d[None, None, :],
                      mask=(inc[:, None] & gmask[None, :])[:, :, None] & dmask[None, None, :], other=0.0)
        acc = acc * tl.exp2(run_lse - nls)[:, None] + tl.sum(w_c[:, :, None] * o_c, axis=0)
        run_lse = new_lse
        run_min = tl.minimum(run_min, tl.min(tl.where(inc[:, None], min_c, float("inf")), axis=0))
        run_dmax = tl.maximum(run_dmax, tl.max(tl.where(inc[:, None], dmx_c, float("-inf")), axis=0))
        cur = tl.maximum(cur, tl.max(tl.where(inc, hi, 0), axis=0))
        fin = (first < (1 << 30)).to(tl.int32)
        c0 += TC

    sm = gmask & active
    tl.store(st_acc_ptr + st_off, acc, mask=sm[:, None] & dmask[None, :])
    tl.store(st_lse_ptr + p64 * GROUP + g, run_lse, mask=sm)
    tl.store(st_min_ptr + p64 * GROUP + g, run_min, mask=sm)
    tl.store(st_dmax_ptr + p64 * GROUP + g, run_dmax, mask=sm)
    tl.store(done_ptr + pair, fin, mask=active)
    tl.store(nread_ptr + pair, cur, mask=active)
    tl.store(kept_ptr + pair, kept, mask=active)
    tl.store(probe_nread_ptr + pair, p_nread, mask=active)
    qo = h * GROUP + g
    tl.store(o_ptr + r64 * stride_ob + qo[:, None] * stride_oh + d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=sm[:, None] & dmask[None, :])
    tl.store(lse_ptr + r64 * stride_lb + qo, run_lse, mask=sm)


def wave_merge(partials, state, out, lse_out, nread_out, kept_out, seq_lens, list_lens, n_forced, chunk_ends,
               epsilon, suffix, probe, *, chunk0: int, n_chunks: int, first: bool, block_size: int, estimator: str,
               calib_slack: float, tile_chunks: int = 16, totals: torch.Tensor | None = None) -> None:
    """Fold chunks ``[chunk0, chunk0 + n_chunks)`` (partial slots ``0..n_chunks-1``) into the state.

    Args:
      partials: ``(o [P, W, G, D], lse [P, W, G], as_min [P, W, G], dmax [P, W, G])`` fp32 (see
        :func:`flashinfer_ext.psa.chunks.psa_chunk_attention`).
      state: ``(acc [P, G, D], lse [P, G], as_min [P, G], dmax [P, G], done [P] int32)``; ``first``
        initialises it (wave 0), later waves read and update it; pairs with ``done`` are untouched.
      out: ``[batch, num_qo_heads, head_dim]``; lse_out: ``[batch, num_qo_heads]`` fp32 base 2;
        nread_out: ``[batch, num_kv_heads]`` int32 ranks read; kept_out: ``[batch, num_kv_heads]`` fp32.
      seq_lens, n_forced: ``[batch]`` int32; list_lens: ``[batch, num_kv_heads]`` int32 contiguous.
      chunk_ends: int32 ``[0] + ranked_chunk_ends``; epsilon: ``[batch]`` fp32.
      suffix: ``[batch, num_kv_heads, >= num_cols + 1]`` fp32 from :func:`bound_suffix` (read only by the
        'bound' / 'calibrated' estimators).
      probe: ``(probe_epsilon [batch] fp32, probe_lens [batch] int32, probe_nread [batch, num_kv_heads] int32
        contiguous)``: the probe's threshold and list cap per row, and its output (written like ``nread``).
      totals: ``[batch * num_kv_heads * group]`` fp32, each query head's base-2 total from
        :func:`flashinfer_ext.psa.key_sketch.sketch_shares` (the 'sketch' estimator only).
    """
    if estimator == "sketch" and totals is None:
        raise ValueError("wave_merge: the 'sketch' estimator needs totals")
    batch, num_qo_heads, head_dim = out.shape
    num_kv_heads = list_lens.shape[1]
    group = num_qo_heads // num_kv_heads
    if batch == 0 or n_chunks == 0:
        return
    po, plse, pmin, pdmax = partials
    st_acc, st_lse, st_min, st_dmax, done = state
    assert out.stride(2) == 1 and suffix.stride(2) == 1 and list_lens.is_contiguous()
    assert nread_out.is_contiguous() and kept_out.is_contiguous() and done.is_contiguous()
    probe_eps, probe_lens, probe_nread = probe
    assert probe_nread.is_contiguous() and probe_nread.shape == nread_out.shape
    _wave_merge_kernel[(batch * num_kv_heads,)](
        po, plse, pmin, pdmax, po.shape[1],
        seq_lens, list_lens, n_forced, chunk_ends, epsilon, suffix, suffix.stride(0), suffix.stride(1),
        st_acc, st_lse, st_min, st_dmax, done, nread_out, kept_out,
        probe_eps, probe_lens, probe_nread, totals if totals is not None else epsilon,
        out, out.stride(0), out.stride(1), lse_out, lse_out.stride(0),
        chunk0, n_chunks, float(calib_slack),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        TC=min(tile_chunks, max(2, triton.next_power_of_2(n_chunks))), FIRST=first,
        ESTIMATOR=ESTIMATOR_IDS[estimator],
    )

