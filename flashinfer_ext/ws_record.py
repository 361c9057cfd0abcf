"""Working-set record: write one step number into every unit a decode step read, one launch per layer (Triton).

:class:`radix_sparse.working_set_tracker.WorkingSetTracker` keeps, per tracked request, the step at which each
(layer, KV head, block) unit was last read. After a layer's PSA decode, the first ``nread[b, h]`` entries of the
rank order ``order[b, h, :]`` are the blocks row ``b`` read for KV head ``h``; this kernel stores ``row_step[b]``
at ``stamp[base[b, h] + layer_off + order[b, h, j]]`` for those ``j``, and touches nothing else.

Supports: ``stamp`` int32, contiguous (addressed flat); ``order`` ``[bs, num_kv_heads, num_cols]`` int64 with a
contiguous last dim; ``nread`` ``[bs, num_kv_heads]`` int32 or int64, contiguous; ``base`` ``[bs, num_kv_heads]``
int64 contiguous (flat offset of the row's slot, layer 0, head h, column 0); ``row_step`` ``[bs]`` int32. Grid
``[bs * num_kv_heads, cdiv(num_cols, BLOCK)]``; no host sync, no allocation: capturable in a CUDA graph (one
launch per layer, ``layer_off`` fixed per launch).

Cautions: the caller guarantees ``base + layer_off + order < stamp.numel()`` for the read entries (the tracker's
shapes do); ``nread`` larger than ``num_cols`` is clipped to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ws_record", "ws_record_reference"]


@triton.jit
def _ws_record_kernel(stamp_ptr, order_ptr, o_stride_b, o_stride_h, nread_ptr, base_ptr, step_ptr, num_kv_heads,
                      num_cols, layer_off, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    n = tl.minimum(tl.load(nread_ptr + pid).to(tl.int32), num_cols)
    j = blk * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    col = tl.load(order_ptr + b.to(tl.int64) * o_stride_b + h * o_stride_h + j, mask=m, other=0)
    base = tl.load(base_ptr + pid) + layer_off
    step = tl.load(step_ptr + b)
    tl.store(stamp_ptr + base + col, tl.zeros([BLOCK], dtype=tl.int32) + step, mask=m)


def ws_record(stamp: torch.Tensor, order: torch.Tensor, nread: torch.Tensor, base: torch.Tensor,
              row_step: torch.Tensor, layer_off: int, block: int = 512) -> None:
    """Store ``row_step[b]`` at ``stamp.view(-1)[base[b, h] + layer_off + order[b, h, j]]`` for ``j < nread[b, h]``
    (see the module docstring for shapes and dtypes)."""
    bs, hk, cols = order.shape
    if bs == 0 or cols == 0:
        return
    if order.stride(2) != 1 or not nread.is_contiguous() or not base.is_contiguous() or not stamp.is_contiguous():
        raise ValueError("ws_record: order needs a contiguous last dim; nread, base and stamp must be contiguous")
    if nread.shape != (bs, hk) or base.shape != (bs, hk) or row_step.shape[0] < bs:
        raise ValueError(f"ws_record: nread {tuple(nread.shape)} / base {tuple(base.shape)} / row_step "
                         f"{tuple(row_step.shape)} do not match order {tuple(order.shape)}")
    grid = (bs * hk, triton.cdiv(cols, block))
    _ws_record_kernel[grid](stamp, order, order.stride(0), order.stride(1), nread, base, row_step, hk, cols,
                            int(layer_off), BLOCK=block)


def ws_record_reference(stamp: torch.Tensor, order: torch.Tensor, nread: torch.Tensor, base: torch.Tensor,
                        row_step: torch.Tensor, layer_off: int) -> None:
    """Pure-torch reference of :func:`ws_record` (same contract; allocates)."""
    bs, hk, cols = order.shape
    valid = torch.arange(cols, device=order.device).view(1, 1, cols) < nread.view(bs, hk, 1).to(torch.int64)
    idx = (base.view(bs, hk, 1) + layer_off + order)[valid]
    vals = row_step[:bs].view(bs, 1, 1).expand(bs, hk, cols)[valid]
    stamp.view(-1)[idx] = vals.to(stamp.dtype)
