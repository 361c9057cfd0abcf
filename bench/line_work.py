"""How much work a vertical/slash line set asks of a prefill, next to dense causal attention.

For one extend segment that starts at position 0 (``seq_len`` query rows over ``seq_len`` keys) and one KV head's
selected lines (:class:`flashinfer_ext.loopserve.vs_select.VSSelection`), :func:`line_work` counts:

* ``area_fraction``: the entries of the causal matrix the mask keeps (key a selected vertical, or offset a selected
  slash; each entry once) over all causal entries: the FLOPs an ideal entry-exact kernel would compute, as a
  share of dense;
* the tiles :func:`flashinfer_ext.loopserve.vs_prefill.vs_prefill` computes with its tile shape (``block_q`` query
  rows x ``block_n`` keys): phase A's gathered vertical tiles (``ceil(v_end / block_n)`` per query block) and
  phase B's key blocks crossed by a selected slash band, each over the causal key blocks of the same tile shape
  (``tile_fraction_a``, ``tile_fraction_b`` and their sum ``tile_fraction``).

Scattered slashes make the two diverge: a slash keeps one diagonal of a tile but phase B computes the whole tile,
so a few thousand slash offsets spread over the context cross nearly every key block. Pure torch on the
selection's device, exact integer counts.
"""

from __future__ import annotations

import torch

__all__ = ["line_work"]


def _lines(idx: torch.Tensor, cnt: torch.Tensor, h: int) -> torch.Tensor:
    return idx[h, : int(cnt[h])].long()


def line_work(v_idx: torch.Tensor, v_cnt: torch.Tensor, s_idx: torch.Tensor, s_cnt: torch.Tensor, seq_len: int,
              *, block_q: int, block_n: int) -> dict:
    """Work of the lines of every KV head (``v_idx`` / ``s_idx`` ``[Hk, W]``, the first ``cnt[h]`` entries valid,
    ascending, distinct, ``< seq_len``) for a segment of ``seq_len`` rows from position 0.

    Returns a dict of floats averaged over the heads: ``area_fraction``, ``tile_fraction_a``, ``tile_fraction_b``,
    ``tile_fraction`` (all over dense causal work) and ``slash_blocks_crossed`` (phase B's key blocks over the
    causal key blocks, = ``tile_fraction_b``), plus ``block_q`` and ``block_n``.
    """
    t = int(seq_len)
    if t <= 0 or block_q < 1 or block_n < 1:
        raise ValueError(f"line_work: seq_len={seq_len}, block_q={block_q}, block_n={block_n} must be >= 1")
    dev = v_idx.device
    hk = v_idx.shape[0]
    n_qb = -(-t // block_q)
    q_lo = torch.arange(n_qb, device=dev) * block_q
    q_hi = torch.clamp(q_lo + block_q, max=t) - 1                      # [n_qb] last row of each query block
    n_kb = -(-t // block_n)
    n0 = torch.arange(n_kb, device=dev) * block_n                      # [n_kb]
    causal_kb = q_hi // block_n + 1                                    # key blocks at or left of each block's last row
    dense_tiles = float(causal_kb.sum())
    causal_entries = t * (t + 1) / 2
    acc = dict(area_fraction=0.0, tile_fraction_a=0.0, tile_fraction_b=0.0)
    for h in range(hk):
        v = _lines(v_idx, v_cnt, h)
        s = _lines(s_idx, s_cnt, h)
        # entries: each vertical k covers rows k..t-1, each slash s rows s..t-1, a (vertical, slash) pair meets once
        # when k + s < t
        area = float((t - v).sum() + (t - s).sum())
        area -= float(torch.searchsorted(s, (t - v).contiguous(), right=False).sum()) if s.numel() else 0.0
        acc["area_fraction"] += area / causal_entries
        # phase A: the verticals <= q_hi, gathered in tiles of block_n
        v_end = torch.searchsorted(v, q_hi.contiguous(), right=True) if v.numel() else torch.zeros_like(q_hi)
        acc["tile_fraction_a"] += float((-(-v_end // block_n)).sum()) / dense_tiles
        # phase B: key block b (keys n0 .. k_hi) is crossed iff a selected offset lies in [q_lo - k_hi, q_hi - n0]
        flag = torch.zeros(t + 1, dtype=torch.long, device=dev)
        flag[s] = 1
        cum = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), flag.cumsum(0)])  # cum[x] = #offsets < x
        k_hi = torch.minimum(n0[None, :] + block_n - 1, q_hi[:, None])               # [n_qb, n_kb]
        lo = (q_lo[:, None] - k_hi).clamp(min=0)
        hi = q_hi[:, None] - n0[None, :]
        live = hi >= 0                                                               # causal key blocks
        hi_c = hi.clamp(min=-1, max=t - 1)
        crossed = live & (cum[hi_c + 1] - cum[lo.clamp(max=t)] > 0)
        acc["tile_fraction_b"] += float(crossed.sum()) / dense_tiles
    out = {k: val / max(hk, 1) for k, val in acc.items()}
    out["tile_fraction"] = out["tile_fraction_a"] + out["tile_fraction_b"]
    out["slash_blocks_crossed"] = out["tile_fraction_b"]
    out.update(block_q=int(block_q), block_n=int(block_n))
    return out
