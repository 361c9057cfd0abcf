"""Greedy alpha-coverage selection of vertical and slash lines (LoopServe Alg. 2, lines 6-18), vectorised.

Supports: the per-KV-head line sums of :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate` (or of its
reference) for one request, one layer; the extend segment at query positions
``[prefix_len, seq_len)``; any device (pure torch: sorts, gathers and cumulative sums, no python
loop per line, no host sync). Output per KV head: the selected vertical key positions and slash
offsets as padded index tensors + counts, always including the sink tokens (verticals
``0..sink_tokens-1``) and the local window (slashes ``0..local_window-1``).

The rule (a vectorised relaxation of Alg. 2's greedy with the same overlap accounting):
  1. Costs are what sparse prefill computes: vertical ``k`` and slash ``d`` each cover
     ``l = seq_len - max(prefix_len, k or d)`` query rows of the segment.
  2. Each list is sorted once by density ``w / l`` (forced sink / local lines first).
  3. Overlap accounting: a slash and a vertical meet in at most one entry of the sampled matrix,
     worth at most ``min(w_s^max, w_v^max)``. Taking ``i`` slashes first and then verticals, the
     ``b``-th vertical gains at least ``w_v - min(ol_s, i * w_v^max)`` (``ol_s`` = sum of the max
     entries of the taken slashes: Alg. 2's ``Δw_v = w_v - ol_s``, tightened by the per-pair
     bound), clamped at 0; symmetrically for verticals first (``Δw_s = w_s - ol_v``). The summed
     gains are a LOWER bound of the mass the lines really cover.
  4. Alg. 2 interleaves the two lists with a state-dependent comparison, one line per step (up to
     ``2 * seq_len`` sequential steps). Instead, for ``split_candidates`` split points ``i``
     (quadratically spaced over the slash list) the cumulative sums of the gains give, in one
     vectorised pass, the fewest verticals reaching ``alpha * total``; the same with the roles
     swapped (:mod:`flashinfer_ext.loopserve.vs_split_search`: one Triton launch for both orders on CUDA, its torch
     reference elsewhere); the (slashes, verticals) pair of least cost ``sum l`` wins. The exact covered mass of
     the sampled rows is therefore ``>= alpha * total`` (Alg. 2's guarantee); ``covered_lb``
     reports the bound. Taking every slash alone covers everything, so a pair always exists.
     ``alpha >= 1`` selects every line (= dense causal attention).

Cautions:
  * the overlap bound is loose where a few heavy columns hold the slashes' max entries: after
    those verticals, every slash is charged its max entry and the bound under-counts the slashes'
    residual mass, so higher alpha then over-selects slashes (still correct, less sparse). A second
    estimation pass with residual slash sums (entries off the selected verticals) would fix it;
    not implemented.
  * index tensors are ``[num_kv_heads, seq_len]`` wide (static shape: no host sync to size
them); entries past the count are ``-1``. Sorting ``2 * seq_len`` keys per KV head is
``O(n log n)`` on the device, the split search ``O(split_candidates * n)``; the selection
  is per request (batching requests of one forward is not implemented yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .vs_estimate import VSLineSums
from .vs_split_search import split_candidates, split_search, split_search_reference

__all__ = ["VSSelectConfig", "VSSelection", "VSSelectPlan", "vs_select", "vs_select_plan", "decode_topb"]


@dataclass(frozen=True)
class VSSelectConfig:
    """Knobs of the alpha-coverage line selection."""

    alpha: float = 0.955
    """covered fraction of the sampled attention mass to reach, in (0, 1]; 1.0 = all lines (dense)."""
    sink_tokens: int = 4
    """key positions ``0..sink_tokens-1`` are always selected as vertical lines."""
    local_window: int = 64
    """slash offsets ``0..local_window-1`` are always selected (offset 0, the diagonal, at least)."""
    split_candidates: int = 16
    """split points tried per list order (memory ``num_kv_heads * 2 * split_candidates * seq_len`` fp32)."""

    def __post_init__(self) -> None:
        def bad(name: str, rng: str) -> ValueError:
            return ValueError(f"VSSelectConfig.{name}={getattr(self, name)!r} is out of range: expected {rng}")

        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha <= 1.0:
            raise bad("alpha", "a number in (0, 1]")
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) \
                or not 0 <= self.sink_tokens <= 1 << 20:
            raise bad("sink_tokens", "an integer in [0, 1048576]")
        if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) \
                or not 1 <= self.local_window <= 1 << 20:
            raise bad("local_window", "an integer in [1, 1048576]")
        if isinstance(self.split_candidates, bool) or not isinstance(self.split_candidates, int) \
                or not 2 <= self.split_candidates <= 256:
            raise bad("split_candidates", "an integer in [2, 256]")


@dataclass
class VSSelection:
    """Selected lines of one request, one layer; ``v_idx`` ascending, ``s_idx`` ascending, ``-1``-padded."""

    v_idx: torch.Tensor      # [num_kv_heads, seq_len] int32 key positions
    v_cnt: torch.Tensor      # [num_kv_heads] int32
    s_idx: torch.Tensor      # [num_kv_heads, seq_len] int32 offsets q_pos - k_pos
    s_cnt: torch.Tensor      # [num_kv_heads] int32
    covered_lb: torch.Tensor  # [num_kv_heads] fp32 lower bound of the covered fraction of sampled mass


def _compact(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[H, n]`` -> ascending indices ``[H, n]`` int32 (-1 padded) and counts ``[H]`` int32."""
    n = mask.shape[1]
    ar = torch.arange(n, device=mask.device, dtype=torch.int32)
    idx = torch.where(mask, ar, torch.full_like(ar, n)).sort(dim=1).values
    idx = torch.where(idx >= n, torch.full_like(idx, -1), idx)
    return idx, mask.sum(1, dtype=torch.int32)


@dataclass(frozen=True)
class VSSelectPlan:
    """What :func:`vs_select` needs besides the line sums, for one extend segment (``seq_len``, ``prefix_len``,
    config, device): built once by :func:`vs_select_plan` and shared by every layer of the segment, so a layer's
    selection issues only the data-dependent device work."""

    seq_len: int
    prefix_len: int
    config: VSSelectConfig
    n_forced: tuple[int, int]   # forced (slashes, verticals): the local window and the sink tokens
    lens: torch.Tensor          # [seq_len] fp32 cost of vertical k / slash d: the segment's rows it covers
    cand: torch.Tensor          # [2, split_candidates] int64 split sizes per list order (device)
    rank: torch.Tensor          # [1, 1, seq_len] int64 0..seq_len-1 (device)
    use_kernel: bool            # the split search as one Triton launch (else its torch reference)


def vs_select_plan(seq_len: int, prefix_len: int, config: VSSelectConfig, device: torch.device | str,
                   use_kernel: bool | None = None) -> VSSelectPlan:
    """The :class:`VSSelectPlan` of a segment at query positions ``[prefix_len, seq_len)`` (host ints; the split
    sizes reach the device in one pinned, non-blocking copy; no sync). ``use_kernel`` defaults to CUDA."""
    n = int(seq_len)
    if not 0 <= prefix_len < max(n, 1):
        raise ValueError(f"prefix_len={prefix_len} is out of range: expected an integer in [0, {n})")
    dev = torch.device(device)
    ar = torch.arange(n, device=dev)
    lens = (n - ar.clamp(min=prefix_len)).to(torch.float32)
    n_forced = (min(config.local_window, n), min(config.sink_tokens, n))
    cand = split_candidates(n, n_forced, config.split_candidates)
    cand = cand.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else cand.to(dev)
    kernel = dev.type == "cuda" if use_kernel is None else bool(use_kernel)
    return VSSelectPlan(n, int(prefix_len), config, n_forced, lens, cand, ar.view(1, 1, n), kernel)


def vs_select(lines: VSLineSums, *, prefix_len: int | None = None, config: VSSelectConfig = VSSelectConfig(),
              use_kernel: bool | None = None, plan: VSSelectPlan | None = None) -> VSSelection:
    """Select per KV head the lines covering ``alpha`` of the sampled mass (see the module docstring).

    Args:
      lines: :class:`VSLineSums` (``[num_kv_heads, seq_len]`` fp32 fields) of one request, one layer.
      prefix_len: first query position of the segment being prefilled (host int, ``< seq_len``).
      config: :class:`VSSelectConfig`.
      use_kernel: the split search as one Triton launch (:func:`flashinfer_ext.loopserve.vs_split_search.split_search`)
        or in torch (its reference); default: the kernel on CUDA.
      plan: a :class:`VSSelectPlan` of this segment (:func:`vs_select_plan`, built once for all its layers); it
        replaces ``prefix_len``, ``config`` and ``use_kernel``.
    Returns :class:`VSSelection` (``v_idx`` / ``s_idx`` are views of one ``[2, num_kv_heads, seq_len]`` tensor).
    About 25 torch ops (one sort of both lists, gathers, the split search, one sort of the kept indices) on
    ``lines``' device; no host sync.
    """
    hk, n = lines.v_sum.shape
    if plan is None:
        if prefix_len is None:
            raise ValueError("vs_select needs prefix_len (or a plan)")
        plan = vs_select_plan(n, prefix_len, config, lines.v_sum.device, use_kernel)
    elif plan.seq_len != n:
        raise ValueError(f"the plan is for seq_len={plan.seq_len}, the line sums cover {n} positions")
    config = plan.config
    if config.alpha >= 1.0:
        ones = torch.ones(hk, n, dtype=torch.bool, device=lines.v_sum.device)
        v_idx, v_cnt = _compact(ones)
        s_idx, s_cnt = _compact(ones)
        return VSSelection(v_idx, v_cnt, s_idx, s_cnt, torch.ones(hk, device=lines.v_sum.device))

    n_fs, n_fv = plan.n_forced
    total = lines.v_sum.sum(1)
    # both lists at once, slashes first: density order (forced sink / local lines first) and the (w, m, l) planes
    w = torch.stack([lines.s_sum, lines.v_sum])
    key = w / plan.lens
    key[0, :, :n_fs] = float("inf")
    key[1, :, :n_fv] = float("inf")
    order = torch.sort(key, dim=2, descending=True, stable=True).indices  # [2, Hk, n]
    m = torch.stack([lines.s_max, lines.v_max])
    planes = torch.stack([w.gather(2, order), m.gather(2, order), plan.lens[order]])  # [3, 2, Hk, n]
    # (cost, slashes, verticals, covered lower bound) per split candidate, slashes-first order then verticals-first
    cost, n_s_all, n_v_all, cov_all = (split_search if plan.use_kernel else split_search_reference)(
        planes, config.alpha * total, plan.cand, plan.n_forced)
    best = cost.argmin(1, keepdim=True)
    cnt = torch.stack([n_s_all, n_v_all]).gather(2, best.expand(2, hk, 1)).clamp(max=n)  # [2, Hk, 1]
    cov = cov_all.gather(1, best).squeeze(1)
    # the first cnt lines of each density order, as ascending positions (-1 padded)
    kept = torch.where(plan.rank < cnt, order, n).sort(dim=2).values
    idx = torch.where(kept >= n, -1, kept).to(torch.int32)
    counts = cnt.squeeze(2).to(torch.int32)
    covered_lb = torch.where(total > 0, cov / total.clamp(min=1e-30), 1.0).clamp(max=1.0)
    return VSSelection(idx[1], counts[1], idx[0], counts[0], covered_lb.to(torch.float32))


def decode_topb(obs_lines: VSLineSums, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Progressive decode re-selection (LoopServe Alg. 3 / Eq. 7): top-``budget`` positions per KV head.

    ``obs_lines`` is :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate` run with the last ``n_d``
    queries as the sampled rows (their positions, causal): its ``v_sum[h, k]`` is exactly Eq. 7's
    score of token ``k`` (attention summed over the observation queries and the group's query heads).
    Returns ``(lists [num_kv_heads, B] int32 ascending, lens [num_kv_heads] int32)`` with
    ``B = min(budget, seq_len)``; for one request, ``lists[None]`` / ``lens[None]`` are the
    ``block_lists`` / ``list_lens`` of :func:`flashinfer_ext.common.sparse_decode.sparse_decode` with
    ``block_size=1``, ``epsilon=1.0`` (union it with the stored lines and the recent tokens first).
    ``torch.topk`` on the device, no host sync; ties break arbitrarily.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} is out of range: expected an integer >= 1")
    hk, n = obs_lines.v_sum.shape
    b = min(budget, n)
    top = torch.topk(obs_lines.v_sum, b, dim=1, sorted=False).indices
    lists = top.sort(dim=1).values.to(torch.int32)
    return lists, torch.full((hk,), b, dtype=torch.int32, device=lists.device)
