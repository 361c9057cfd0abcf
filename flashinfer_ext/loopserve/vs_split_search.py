"""The split search of :func:`flashinfer_ext.loopserve.vs_select.vs_select` (step 4 of its rule), both list orders in one
Triton launch, with its pure-torch reference.

Supports: one request, one layer, ``num_kv_heads`` heads; the two line lists (slashes, verticals) already
sorted by density per head (``w`` mass, ``m`` max entry, ``l`` cost per line, ``[num_kv_heads, n]`` fp32
each); ``K`` split sizes per order. Order 0 takes ``cand[0, k]`` slashes first, then the fewest verticals
reaching ``target``; order 1 takes ``cand[1, k]`` verticals first, then the fewest slashes. For each
(head, order, k) the gains of the second list are ``max(w_b - min(ol_a, cand * m_b), 0)`` (``ol_a`` = the
summed max entries of the lines taken first: the overlap bound) and ``lb_cov[t]`` = the mass of the first
list's ``cand`` lines + the first ``t`` gains (``t = 0..n``); the second list takes
``j = max(#{t: lb_cov[t] < target}, n_forced_b)`` lines, feasible iff ``j <= n``.

Outputs ``[num_kv_heads, 2 * K]`` (order 0's ``K`` columns first): ``cost`` (summed line costs; ``inf`` if
infeasible), ``n_s`` / ``n_v`` (slashes / verticals taken) and ``cov`` (``lb_cov`` at the taken count).

The kernel (grid ``[num_kv_heads, 2 * K]``) scans the second list once per program in ``BLOCK`` chunks
(a block cumsum + a running carry), so no ``[num_kv_heads, K, n]`` tensor exists: the torch form
materialises four of them and ~35 small ops per order (at 32k keys that form is host-bound at ~5 ms a
call on an H100, and at 128k its cumsum over ``[8, 16, 131072]`` takes 2 ms).

Cautions:
  * fp32 scans in a different association than ``torch.cumsum``: where ``lb_cov`` lands within rounding
    of ``target`` the two may take one line more or less (the coverage guarantee holds either way).
  * ``cand`` must be ``<= n``; not checked on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["split_candidates", "split_search", "split_search_reference"]


def split_candidates(n: int, n_forced: tuple[int, int], k: int) -> torch.Tensor:
    """``[2, k]`` int64 (CPU) split sizes per order: ``n_forced[o]`` (the forced lines of the list taken first)
    plus a quadratic spacing over the rest (repeats are harmless)."""
    frac = torch.linspace(0.0, 1.0, k) ** 2
    return torch.stack([(f + torch.round(frac * (n - f))).long() for f in n_forced])


# n and the strides of the [3, 2, Hk, n] planes follow the context length: not specialized, so a new length compiles
# no new binary (tests/flashinfer_ext/test_kernel_specialization.py)
@triton.jit(do_not_specialize=["n", "stride_wq", "stride_wo", "stride_wh"])
def _split_search_kernel(cx_ptr, stride_cq, stride_co, stride_ch, w_ptr, stride_wq, stride_wo, stride_wh,
                         cand_ptr, target_ptr, nfs, nfv, n, K,
                         cost_ptr, ns_ptr, nv_ptr, cov_ptr, stride_oh, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    c = tl.program_id(1)
    o = c // K
    cnd = tl.load(cand_ptr + c)                       # lines of the first list (a = list o)
    # prefix sums of list a (w, m, l planes of cx) at cnd; list b is list 1 - o
    a_base = cx_ptr + o * stride_co + h * stride_ch + cnd
    cs_a = tl.load(a_base)
    ol_a = tl.load(a_base + stride_cq)
    cl_a = tl.load(a_base + 2 * stride_cq)
    tgt = tl.load(target_ptr + h)
    n_fb = tl.where(o == 0, nfv, nfs)
    wb_row = w_ptr + (1 - o) * stride_wo + h * stride_wh
    cnd_f = cnd.to(tl.float32)
    carry = cs_a
    cnt = (cs_a < tgt).to(tl.int32)                   # t = 0
    first_ge = tl.where(cs_a >= tgt, cs_a, float("inf"))
    v_nfb = cs_a
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ok = i < n
        wb = tl.load(wb_row + i, mask=ok, other=0.0)
        mb = tl.load(wb_row + stride_wq + i, mask=ok, other=0.0)
        gain = tl.where(ok, tl.maximum(wb - tl.minimum(ol_a, cnd_f * mb), 0.0), 0.0)
        cs = carry + tl.cumsum(gain, 0)               # lb_cov[i + 1]
        cnt += tl.sum(((cs < tgt) & ok).to(tl.int32), 0)
        first_ge = tl.minimum(first_ge, tl.min(tl.where((cs >= tgt) & ok, cs, float("inf")), 0))
        v_nfb = tl.where((n_fb > i0) & (n_fb <= i0 + BLOCK),
                         tl.sum(tl.where(i + 1 == n_fb, cs, 0.0), 0), v_nfb)
        carry = carry + tl.sum(gain, 0)
    j = tl.maximum(cnt, n_fb)
    feasible = j <= n
    j = tl.minimum(j, n)
    cl_b = tl.load(cx_ptr + 2 * stride_cq + (1 - o) * stride_co + h * stride_ch + j)
    cost = tl.where(feasible, cl_a + cl_b, float("inf"))
    cov = tl.where(feasible, tl.where(cnt >= n_fb, first_ge, v_nfb), carry)
    out = h * stride_oh + c
    tl.store(cost_ptr + out, cost)
    tl.store(ns_ptr + out, tl.where(o == 0, cnd, j).to(tl.int32))
    tl.store(nv_ptr + out, tl.where(o == 0, j, cnd).to(tl.int32))
    tl.store(cov_ptr + out, cov)


def _prefix(lists: torch.Tensor) -> torch.Tensor:
    """``[3, 2, Hk, n]`` (w, m, l planes x slash / vertical list) -> their prefix sums ``[3, 2, Hk, n + 1]``."""
    return torch.nn.functional.pad(lists.cumsum(3), (1, 0))


def split_search(lists: torch.Tensor, target: torch.Tensor, cand: torch.Tensor, n_forced: tuple[int, int],
                 block: int = 1024):
    """Both orders' split search in one launch (module docstring).

    Args:
      lists: ``[3, 2, num_kv_heads, n]`` fp32 contiguous: planes (w, m, l) of the density-sorted slash
        (index 0) and vertical (index 1) lists.
      target: ``[num_kv_heads]`` fp32 mass to reach.
      cand: ``[2, K]`` int64 on the device, :func:`split_candidates`.
      n_forced: host ints ``(forced slashes, forced verticals)``.
    Returns ``(cost [Hk, 2K] fp32, n_s [Hk, 2K] int32, n_v [Hk, 2K] int32, cov [Hk, 2K] fp32)``: a prefix sum
    and one launch, no host sync.
    """
    _, _, hk, n = lists.shape
    k = cand.shape[1]
    cx = _prefix(lists)
    kw = dict(device=lists.device)
    cost = torch.empty(hk, 2 * k, dtype=torch.float32, **kw)
    cov = torch.empty_like(cost)
    n_s = torch.empty(hk, 2 * k, dtype=torch.int32, **kw)
    n_v = torch.empty_like(n_s)
    _split_search_kernel[(hk, 2 * k)](
        cx, cx.stride(0), cx.stride(1), cx.stride(2), lists, lists.stride(0), lists.stride(1), lists.stride(2),
        cand.contiguous(), target.contiguous(), n_forced[0], n_forced[1], n, k, cost, n_s, n_v, cov, cost.stride(0),
        BLOCK=block)
    return cost, n_s, n_v, cov


def split_search_reference(lists: torch.Tensor, target: torch.Tensor, cand: torch.Tensor,
                           n_forced: tuple[int, int]):
    """Pure-torch :func:`split_search` (same arguments and results; ``[Hk, K, n]`` intermediates)."""
    _, _, hk, n = lists.shape
    cx = _prefix(lists)
    tgt = target[:, None, None]
    outs = []
    for o in (0, 1):
        c = cand[o].to(lists.device)
        cs_a, ol_a, cl_a = (cx[q, o][:, c] for q in range(3))                       # [Hk, K]
        wb, mb = lists[0, 1 - o], lists[1, 1 - o]
        over = torch.minimum(ol_a[:, :, None], c.float()[None, :, None] * mb[:, None, :])
        gain = (wb[:, None, :] - over).clamp(min=0.0)                                   # [Hk, K, n]
        lb_cov = cs_a[:, :, None] + torch.nn.functional.pad(gain.cumsum(2), (1, 0))
        j = (lb_cov < tgt).sum(2).clamp(min=n_forced[1 - o])
        feasible = j <= n
        j = j.clamp(max=n)
        cost = torch.where(feasible, cl_a + cx[2, 1 - o].gather(1, j), torch.full_like(cl_a, float("inf")))
        cov = lb_cov.gather(2, j[:, :, None]).squeeze(2)
        cc = c[None, :].expand(hk, -1)
        outs.append((cost, (cc if o == 0 else j).to(torch.int32), (j if o == 0 else cc).to(torch.int32), cov))
    return tuple(torch.cat([a, b], 1) for a, b in zip(*outs))
