"""LoopServe decode over per-(row, KV head) token lists, behind a plan()/run() wrapper (as PSA's
:class:`flashinfer_ext.psa.decode.PsaDecodeWrapper`).

:class:`VerticalSlashDecode` owns the step's buffers: the rows' lengths ``[n]`` int32, the forced-entry counts
``[n]`` int32 (zero: every list entry is attended), the side outputs ``lse [n, num_qo_heads]`` fp32 and
``nread [n, num_kv_heads]`` int32 (written, never read back) and the split-decode partials
``[n * num_qo_heads, splits, head_dim]`` / ``[n * num_qo_heads, splits]`` fp32. :meth:`VerticalSlashDecode.plan`
runs once per decode step: it copies the rows' lengths into those buffers (device to device, no host sync),
plans the split over the lists and returns a :class:`VSDecodePlan` of views of them;
:meth:`VerticalSlashDecode.run` runs per layer and takes tensors only.

* ``max_batch > 0`` (CUDA graphs): the buffers are allocated once for ``max_batch`` rows and lists of
  ``list_width`` entries, so a captured graph reads fixed addresses; a larger plan raises.
* ``max_batch == 0`` (eager): the buffers grow to the largest batch / split count seen.
* ``batch_invariant`` (for ``--enable-deterministic-inference``): every step is split as a batch of one row would
  be (the most spans), and always through the split kernel and its merge, so a row's output never depends on the
  rows beside it. Without it the span length shrinks as the batch grows (fewer spans per list keep about two waves
  of programs), which moves the fp32 rounding of a row with the batch. Costs more programs and partials at larger
  batches.

Paths: kernels (:func:`flashinfer_ext.common.split_decode.sparse_decode_split` when the plan has more than one
span or is batch invariant, else :func:`flashinfer_ext.common.sparse_decode.sparse_decode` with ``block_size=1`` and
``epsilon=1``)
or the fp32 reference (:func:`flashinfer_ext.loopserve.reference.masked_decode_reference` over the lists as a
mask). ``use_kernels`` is an explicit argument; nothing reads the environment here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VSDecodePlan:
    """One decode step's planned views: ``req_pool_indices [n]``, ``seq_lens [n]`` int32, ``n_forced [n]`` int32,
    ``lse [n, Hq]`` fp32, ``nread [n, Hk]`` int32, the split plan (None: not planned, e.g. the reference path)
    and its partials (None when one span covers the lists), ``max_len`` (longest context, the reference's mask)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    n_forced: torch.Tensor
    lse: torch.Tensor
    nread: torch.Tensor
    split: object | None
    partial_o: torch.Tensor | None
    partial_lse: torch.Tensor | None
    max_len: int


class VerticalSlashDecode:
    """Decode of rows ``q [n, Hq, D]`` over per-(row, KV head) token lists, plan() once per step, run() per layer.

    Args: ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``device``; ``use_kernels`` (kernels or the fp32
    reference); ``list_width`` (lists are split as if at least this wide, so eager and graph steps give the same
    outputs); ``max_batch`` (> 0: fixed buffers for graphs, see the module docstring); ``batch_invariant`` (the
    same spans at every batch size, see the module docstring).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, *,
                 use_kernels: bool, list_width: int = 1, max_batch: int = 0, target_programs: int = 1,
                 batch_invariant: bool = False):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device, self.use_kernels, self.list_width = device, use_kernels, list_width
        self.batch_invariant = batch_invariant
        self.fixed = max_batch > 0
        self._rows = 0
        self._splits = 0
        if self.fixed:
            splits = self._plan_split(list_width, num_kv_heads, target_programs).num_splits if use_kernels else 0
            self._alloc_rows(max_batch, ones=True)
            self._alloc_partials(max_batch, splits)

    # ------------------------------------------------------------------ buffers
    def _alloc_rows(self, n: int, ones: bool = False) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        self._seq_lens_buf = torch.ones(n, **i32) if ones else torch.empty(n, **i32)
        self._n_forced_buf = torch.zeros(n, **i32)
        self._lse_buf = torch.zeros(n, self.num_qo_heads, dtype=torch.float32, device=self.device)
        self._nread_buf = torch.zeros(n, self.num_kv_heads, **i32)
        self._rows = n

    def _alloc_partials(self, n: int, splits: int) -> None:
        f32 = dict(dtype=torch.float32, device=self.device)
        self._partial_o_buf = torch.zeros(n * self.num_qo_heads, max(splits, 1), self.head_dim, **f32)
        self._partial_lse_buf = torch.zeros(n * self.num_qo_heads, max(splits, 1), **f32)
        self._splits = splits

    def _ensure(self, n: int, splits: int) -> None:
        if self.fixed:
            if n > self._rows or splits > max(self._splits, 1):
                raise RuntimeError(f"VerticalSlashDecode: a plan of {n} rows / {splits} splits exceeds the fixed "
                                   f"buffers ({self._rows} rows, {self._splits} splits)")
            return
        if n > self._rows:
            self._alloc_rows(n)
        if (splits > 1 or (splits and self.batch_invariant)) and (splits > self._splits or n > self._partial_rows()):
            self._alloc_partials(max(n, self._partial_rows()), max(splits, self._splits))

    def _partial_rows(self) -> int:
        return self._partial_o_buf.shape[0] // self.num_qo_heads if self._splits else 0

    @staticmethod
    def _plan_split(list_width: int, pairs: int, target_programs: int):
        from flashinfer_ext.common.split_decode import plan_splits

        return plan_splits(list_width, pairs, block_size=1, target_programs=target_programs)

    # ------------------------------------------------------------------ plan / run
    def plan(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor | None, *, max_len: int, list_width: int,
             target_programs: int, split: bool = True) -> VSDecodePlan:
        """Plan one decode step of ``n = req_pool_indices.shape[0]`` rows.

        ``req_pool_indices [n]`` (device; kept by reference), ``seq_lens [n]`` int (device; copied into the int32
        buffer, no host sync; None keeps the buffer as it is: a graph capture), ``max_len`` the longest context
        (host int), ``list_width`` the widest list this step (host int; split as if at least ``self.list_width``),
        ``split`` False: no split plan (a step planned for a graph replay, which replays the captured plan)."""
        n = int(req_pool_indices.shape[0])
        sp = None
        if self.use_kernels and split:  # batch invariant: planned as for one row, whatever the batch
            pairs = self.num_kv_heads if self.batch_invariant else n * self.num_kv_heads
            sp = self._plan_split(max(list_width, self.list_width), pairs, target_programs)
        self._ensure(n, sp.num_splits if sp is not None else 0)
        if seq_lens is not None:
            self._seq_lens_buf[:n].copy_(seq_lens)
        multi = sp is not None and (sp.num_splits > 1 or self.batch_invariant)
        return VSDecodePlan(req_pool_indices, self._seq_lens_buf[:n], self._n_forced_buf[:n], self._lse_buf[:n],
                            self._nread_buf[:n], sp,
                            self._partial_o_buf[: n * self.num_qo_heads] if multi else None,
                            self._partial_lse_buf[: n * self.num_qo_heads] if multi else None, int(max_len))

    def run(self, plan: VSDecodePlan, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
            req_to_token: torch.Tensor, lists: torch.Tensor, lens: torch.Tensor, sm_scale: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q [n, Hq, D]`` over ``lists [n, Hk, W]`` int32 (first ``lens [n, Hk]`` int32 entries;
        token positions) of one layer's ``k_buf`` / ``v_buf`` ``[slots, Hk, D]`` through ``req_to_token``; into
        ``out [n, Hq, D]`` when given. Returns the output ``[n, Hq, D]``. No host sync on the kernel path."""
        if self.use_kernels and plan.split is not None and plan.partial_o is not None:  # split (or batch invariant)
            from flashinfer_ext.common.split_decode import sparse_decode_split

            o, _, _ = sparse_decode_split(q if q.stride(2) == 1 else q.contiguous(), k_buf, v_buf, req_to_token,
                                          plan.req_pool_indices, plan.seq_lens, lists, lens, plan.split, block_size=1,
                                          sm_scale=sm_scale, partial_o_buf=plan.partial_o,
                                          partial_lse_buf=plan.partial_lse, out=out, lse_out=plan.lse,
                                          nread_out=plan.nread)
            return o
        if self.use_kernels:  # lists short enough for one program per (row, KV head)
            from flashinfer_ext.common.sparse_decode import sparse_decode

            o, _, _ = sparse_decode(q if q.stride(2) == 1 else q.contiguous(), k_buf, v_buf, req_to_token,
                                    plan.req_pool_indices, plan.seq_lens, lists, lens, plan.n_forced, block_size=1,
                                    sm_scale=sm_scale, epsilon=1.0, out=out, lse_out=plan.lse, nread_out=plan.nread)
            return o
        from flashinfer_ext.common.sparse_decode import lists_to_mask
        from flashinfer_ext.loopserve.reference import masked_decode_reference

        o = masked_decode_reference(q, k_buf, v_buf, req_to_token, plan.req_pool_indices,
                                    lists_to_mask(lists, lens, plan.max_len), sm_scale)
        if out is not None:
            out.copy_(o)
            return out
        return o
