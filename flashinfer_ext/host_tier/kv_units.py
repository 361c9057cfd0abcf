"""Convert KV pages between SGLang's token-major pool layout and host-tier units (pure torch).

SGLang's device pool keeps per layer ``k_buffer[layer]`` / ``v_buffer[layer]`` as ``[slots, num_kv_heads,
head_dim]`` (token-major, (N, H, D)); with page size ``P`` page ``p`` is slots ``[p * P, (p + 1) * P)``.
The host tier (``radix_sparse.host_pool``) stores units ``[2 (k, v), P, head_dim]`` per (layer, block,
KV head), (H, N, D) inside a block. These helpers move a set of pages, all layers, in the unit order
of ``HostBlockPool.unit_ids(blocks)`` (layer-major, then block in the given order, then head), so the
packed rows are exactly the ``rows`` of one ``HostSave.save(rows, pool.unit_ids(blocks))``: the
SparseServe save path of a radix node evicted from the GPU, and its inverse for a prefix hit that
brings the node back.

  * ``pack_pages(k_bufs, v_bufs, pages, page_size, out)``: ``out`` ``[num_layers * n * H, 2 * P * D]``
    (the transpose happens on the device, one ``index_select`` + one strided copy per layer).
  * ``unpack_units(rows, k_bufs, v_bufs, pages, page_size)``: the inverse, writing the pages' slots.
  * ``pack_pages_reference``: a python loop over (layer, page, head) (the tests' oracle).

Shapes/dtypes: ``k_bufs``/``v_bufs`` sequences of ``num_layers`` tensors ``[slots, H, D]`` (any one
dtype, contiguous), ``pages`` int64 ``[n]`` on their device (distinct for ``unpack_units``). Both are
plain copies, bit-exact. Cautions: ``slots`` must be a multiple of ``page_size`` covering the pages
(SGLang's pool has one padding slot per page size; pass the page-aligned prefix ``buf[:num_pages * P]``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["pack_pages", "unpack_units", "pack_pages_reference"]


def _paged(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    if buf.dim() != 3 or not buf.is_contiguous() or buf.shape[0] % page_size:
        raise ValueError(f"KV buffer must be a contiguous [slots, num_kv_heads, head_dim] tensor with slots a "
                         f"multiple of page_size={page_size}, got {tuple(buf.shape)}")
    return buf.view(buf.shape[0] // page_size, page_size, buf.shape[1], buf.shape[2])


def _check(k_bufs, v_bufs, pages, page_size, rows_shape) -> tuple[int, int, int]:
    if len(k_bufs) != len(v_bufs) or not k_bufs:
        raise ValueError("k_bufs and v_bufs must be non-empty sequences of one length (one per layer)")
    if pages.dim() != 1 or pages.dtype != torch.int64:
        raise ValueError("pages must be a 1-D int64 tensor")
    h, d = k_bufs[0].shape[1], k_bufs[0].shape[2]
    want = (len(k_bufs) * pages.numel() * h, 2 * page_size * d)
    if tuple(rows_shape) != want:
        raise ValueError(f"rows must be [num_layers * n * num_kv_heads, 2 * page_size * head_dim] = {want}, "
                         f"got {tuple(rows_shape)}")
    return len(k_bufs), h, d


def pack_pages(k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor], pages: torch.Tensor,
               page_size: int, out: torch.Tensor) -> torch.Tensor:
    """Pages of every layer -> unit rows ``out`` (see module docstring); returns ``out``."""
    nl, h, d = _check(k_bufs, v_bufs, pages, page_size, out.shape)
    n = pages.numel()
    view = out.view(nl, n, h, 2, page_size, d)
    for layer in range(nl):
        for kv, bufs in enumerate((k_bufs, v_bufs)):
            src = _paged(bufs[layer], page_size).index_select(0, pages)  # [n, P, H, D]
            view[layer, :, :, kv].copy_(src.permute(0, 2, 1, 3))
    return out


def unpack_units(rows: torch.Tensor, k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor],
                 pages: torch.Tensor, page_size: int) -> None:
    """Unit rows (``pack_pages`` order) -> the pages' slots of every layer's K/V buffers."""
    nl, h, d = _check(k_bufs, v_bufs, pages, page_size, rows.shape)
    n = pages.numel()
    view = rows.view(nl, n, h, 2, page_size, d)
    for layer in range(nl):
        for kv, bufs in enumerate((k_bufs, v_bufs)):
            _paged(bufs[layer], page_size).index_copy_(0, pages, view[layer, :, :, kv].permute(0, 2, 1, 3))


def pack_pages_reference(k_bufs, v_bufs, pages, page_size) -> torch.Tensor:
    """Python loop over (layer, page, head): row = cat(K[page slots, head].flatten(), V[...].flatten())."""
    out = []
    for layer in range(len(k_bufs)):
        for p in pages.tolist():
            for head in range(k_bufs[layer].shape[1]):
                sl = slice(p * page_size, (p + 1) * page_size)
                out.append(torch.cat([k_bufs[layer][sl, head].flatten(), v_bufs[layer][sl, head].flatten()]))
    return torch.stack(out)
