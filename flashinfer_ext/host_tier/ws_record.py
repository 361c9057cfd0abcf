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

Token-list variant (:func:`ws_record_tokens`, LoopServe decode): the selector names the tokens a row read per KV
head, ``lists[b, h, :]`` (token positions, int32), not ranked blocks. For each listed token ``t`` with
``0 <= t`` (and ``j < lens[b, h]`` when ``lens`` is given) and ``t // block_size < max_blocks``, the kernel stores
``row_step[b]`` at ``stamp[base[b, h] + layer_off + t // block_size]``. Supports: ``lists``
``[bs, num_kv_heads, width]`` int32 with a contiguous last dim (other strides free: a slice of a wider buffer),
``-1`` padded and/or with ``lens`` ``[bs, num_kv_heads]`` int32 (any strides); ``stamp``, ``base``, ``row_step``
as above. Grid ``[bs * num_kv_heads, cdiv(width, BLOCK)]``; no host sync, no allocation, graph-safe. Several
tokens of one block (and duplicate tokens) store the same value, so the write races are benign. Cautions:
entries past ``lens`` are never read (they may hold anything); tokens whose block is ``>= max_blocks`` are
skipped (not clipped into the last block); ``block_size`` is the tracker's block, e.g. the KV page.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ws_record", "ws_record_reference", "ws_record_tokens", "ws_record_tokens_reference"]


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


@triton.jit
def _ws_record_tokens_kernel(stamp_ptr, lists_ptr, l_stride_b, l_stride_h, lens_ptr, n_stride_b, n_stride_h, base_ptr,
                             step_ptr, num_kv_heads, width, layer_off, block_size, max_blocks,
                             HAS_LENS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    j = blk * BLOCK + tl.arange(0, BLOCK)
    m = j < width
    if HAS_LENS:
        m = m & (j < tl.load(lens_ptr + b.to(tl.int64) * n_stride_b + h * n_stride_h))
    tok = tl.load(lists_ptr + b.to(tl.int64) * l_stride_b + h * l_stride_h + j, mask=m, other=-1)
    col = tok // block_size
    m = m & (tok >= 0) & (col < max_blocks)
    base = tl.load(base_ptr + pid) + layer_off
    step = tl.load(step_ptr + b)
    tl.store(stamp_ptr + base + col.to(tl.int64), tl.zeros([BLOCK], dtype=tl.int32) + step, mask=m)


def _check_tokens(stamp, lists, lens, base, row_step, block_size, max_blocks) -> None:
    bs, hk, _ = lists.shape
    if lists.dtype != torch.int32 or (lens is not None and lens.dtype != torch.int32):
        raise ValueError(f"ws_record_tokens: lists / lens must be int32, got {lists.dtype} / "
                         f"{None if lens is None else lens.dtype}")
    if (lens is not None and lens.shape != (bs, hk)) or base.shape != (bs, hk) or row_step.shape[0] < bs:
        raise ValueError(f"ws_record_tokens: lens {None if lens is None else tuple(lens.shape)} / base "
                         f"{tuple(base.shape)} / row_step {tuple(row_step.shape)} do not match lists {tuple(lists.shape)}")
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"ws_record_tokens: block_size={block_size} and max_blocks={max_blocks} must be >= 1")


def ws_record_tokens(stamp: torch.Tensor, lists: torch.Tensor, lens: torch.Tensor | None, base: torch.Tensor,
                     row_step: torch.Tensor, layer_off: int, *, block_size: int, max_blocks: int,
                     block: int = 256) -> None:
    """Store ``row_step[b]`` at ``stamp.view(-1)[base[b, h] + layer_off + lists[b, h, j] // block_size]`` for the
    valid entries of ``lists [bs, num_kv_heads, width]`` int32 (``j < lens[b, h]`` when ``lens`` is given, the
    token ``>= 0``, its block ``< max_blocks``); one launch (see the module docstring for shapes and dtypes)."""
    bs, hk, width = lists.shape
    if bs == 0 or width == 0:
        return
    _check_tokens(stamp, lists, lens, base, row_step, block_size, max_blocks)
    if lists.stride(2) != 1 or not base.is_contiguous() or not stamp.is_contiguous():
        raise ValueError("ws_record_tokens: lists needs a contiguous last dim; base and stamp must be contiguous")
    has_lens = lens is not None
    lens_arg = lens if has_lens else base  # never read without lens
    grid = (bs * hk, triton.cdiv(width, block))
    _ws_record_tokens_kernel[grid](stamp, lists, lists.stride(0), lists.stride(1), lens_arg,
                                   lens.stride(0) if has_lens else 0, lens.stride(1) if has_lens else 0, base,
                                   row_step, hk, width, int(layer_off), int(block_size), int(max_blocks),
                                   HAS_LENS=has_lens, BLOCK=block)


def ws_record_tokens_reference(stamp: torch.Tensor, lists: torch.Tensor, lens: torch.Tensor | None,
                               base: torch.Tensor, row_step: torch.Tensor, layer_off: int, *, block_size: int,
                               max_blocks: int) -> None:
    """Pure-torch reference of :func:`ws_record_tokens` (same contract; allocates)."""
    bs, hk, width = lists.shape
    if bs == 0 or width == 0:
        return
    _check_tokens(stamp, lists, lens, base, row_step, block_size, max_blocks)
    tok = lists.to(torch.int64)
    col = torch.div(tok, block_size, rounding_mode="floor")
    valid = (tok >= 0) & (col < max_blocks)
    if lens is not None:
        valid &= torch.arange(width, device=lists.device).view(1, 1, width) < lens.view(bs, hk, 1).to(torch.int64)
    idx = (base.view(bs, hk, 1) + layer_off + col)[valid]
    vals = row_step[:bs].view(bs, 1, 1).expand(bs, hk, width)[valid]
    stamp.view(-1)[idx] = vals.to(stamp.dtype)
