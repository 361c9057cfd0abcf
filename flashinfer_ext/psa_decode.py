"""PSA progressive threshold decode (PSA Alg. 1) as a FlashInfer-style plan()/run() wrapper.

Supports: a batch of decode requests over SGLang's KV pool (``[num_slots, num_kv_heads,
head_dim]`` per layer, ``req_to_token``), block metadata from
:mod:`flashinfer_ext.block_meta` (page size > 1: blocks = pages; page size 1: logical
blocks of ``block_size`` positions), GQA with the query-head group taken into the
criticality bound explicitly, bf16/fp16.

Per layer, :meth:`PsaDecodeWrapper.run` launches three device ops and nothing else:
criticality (Triton) -> descending device sort -> progressive sparse decode
(Triton, stop test on the GPU). No ``.item()``, no host sync, no allocation of its
own, fixed shapes: capture it in a CUDA graph and replay after :meth:`plan` refreshed
the preallocated ``_buf`` tensors in place.

Cautions:
  * :meth:`plan` once per batch (outside any graph): copies the per-request indices and
    lengths into ``_buf`` tensors and derives forced counts / read caps on the device.
  * For graph capture plan with ``max_seq_len=None`` (full ``max_blocks_per_req``
    columns): the sort width must not change between capture and replay.
  * The new decode token's K/V must be in the pool and its block metadata updated
    (:meth:`update_meta_decode`) before :meth:`run`.
"""

from __future__ import annotations

import torch

from .block_meta import update_block_meta
from .config import PsaDecodeConfig
from .criticality import block_criticality, rank_blocks
from .sparse_decode import sparse_decode

__all__ = ["PsaDecodeWrapper"]


class PsaDecodeWrapper:
    """Progressive threshold decode for up to ``max_batch_size`` requests.

    Args:
      config: :class:`PsaDecodeConfig`.
      num_qo_heads, num_kv_heads, head_dim: attention shape (``num_qo_heads % num_kv_heads == 0``).
      block_size: tokens per block (the page size for page size > 1).
      max_batch_size: largest batch :meth:`plan` accepts.
      max_blocks_per_req: ``ceil(max_context_len / block_size)``; the sort width.
      sm_scale: softmax scale (default ``head_dim ** -0.5``).
      out_dtype: dtype of the attention output buffer.
    """

    def __init__(self, config: PsaDecodeConfig, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, max_batch_size: int, max_blocks_per_req: int,
                 device: str | torch.device = "cuda", sm_scale: float | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, tile_tokens: int = 64):
        if not isinstance(config, PsaDecodeConfig):
            raise TypeError(f"config must be a PsaDecodeConfig, got {type(config).__name__}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.config = config
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_blocks_per_req = max_blocks_per_req
        self.sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
        self.tile_tokens = tile_tokens
        dev = torch.device(device)
        i32 = dict(dtype=torch.int32, device=dev)
        n = max_batch_size * num_kv_heads * max_blocks_per_req
        self._req_pool_indices_buf = torch.zeros(max_batch_size, **i32)
        self._seq_lens_buf = torch.zeros(max_batch_size, **i32)
        self._start_buf = torch.zeros(max_batch_size, **i32)
        self._n_forced_buf = torch.zeros(max_batch_size, **i32)
        self._list_lens_buf = torch.zeros(max_batch_size, num_kv_heads, **i32)
        self._block_table_buf = torch.zeros(max_batch_size, max_blocks_per_req, **i32)
        self._scores_buf = torch.empty(n, dtype=torch.float32, device=dev)
        self._sorted_buf = torch.empty(n, dtype=torch.float32, device=dev)
        self._order_buf = torch.empty(n, dtype=torch.int64, device=dev)
        self._o_buf = torch.empty(max_batch_size, num_qo_heads, head_dim, dtype=out_dtype, device=dev)
        self._lse_buf = torch.empty(max_batch_size, num_qo_heads, dtype=torch.float32, device=dev)
        self._nread_buf = torch.zeros(max_batch_size, num_kv_heads, **i32)
        self._req_to_token = None
        self._bs = 0
        self._num_cols = max_blocks_per_req

    def plan(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, max_seq_len: int | None = None) -> None:
        """Prepare one decode batch (host or device inputs; copies into the ``_buf`` tensors).

        Args:
          req_to_token: ``[max_reqs, max_context_len]`` int32 on the device (kept by reference).
          req_pool_indices: ``[batch]``; seq_lens: ``[batch]`` tokens incl. the one being decoded.
          block_table: ``[batch, >= n_blocks]`` int32 logical block -> meta row (see
            :func:`flashinfer_ext.block_meta.paged_block_table` / ``identity_block_table``).
          max_seq_len: optional host bound to narrow the sort width (eager mode only).
        """
        bs = int(req_pool_indices.shape[0])
        if bs > self.max_batch_size:
            raise ValueError(f"batch {bs} exceeds max_batch_size={self.max_batch_size}")
        cfg, bsz = self.config, self.block_size
        self._req_to_token = req_to_token
        self._bs = bs
        cols = self.max_blocks_per_req
        if max_seq_len is not None:
            cols = max(1, min(cols, -(-int(max_seq_len) // bsz)))
        self._num_cols = cols
        self._req_pool_indices_buf[:bs].copy_(req_pool_indices, non_blocking=True)
        self._seq_lens_buf[:bs].copy_(seq_lens, non_blocking=True)
        w = min(block_table.shape[1], self.max_blocks_per_req)
        self._block_table_buf[:bs, :w].copy_(block_table[:, :w], non_blocking=True)
        sl = self._seq_lens_buf[:bs]
        torch.sub(sl, 1, out=self._start_buf[:bs])
        n_blocks = torch.div(sl + (bsz - 1), bsz, rounding_mode="floor")
        self._n_forced_buf[:bs].copy_(torch.clamp(n_blocks, max=cfg.sink_blocks + cfg.local_blocks))
        limit = torch.minimum(n_blocks, self._n_forced_buf[:bs] + cfg.max_blocks).clamp_(max=cols)
        self._list_lens_buf[:bs].copy_(limit[:, None].expand(bs, self.num_kv_heads))

    def update_meta_decode(self, k_buffer: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                           kmean: torch.Tensor) -> None:
        """Fold each request's newest key (position ``seq_len - 1``) into its block's metadata.

        ``k_buffer`` ``[num_slots, num_kv_heads, head_dim]`` and ``kmin/kmax/kmean``
        ``[num_rows, num_kv_heads, head_dim]`` of one layer. Graph-capturable.
        """
        bs = self._bs
        update_block_meta(k_buffer, kmin, kmax, kmean, self._req_to_token, self._req_pool_indices_buf[:bs],
                          self._block_table_buf[:bs], self._start_buf[:bs], self._seq_lens_buf[:bs],
                          block_size=self.block_size, max_new_blocks=1)

    def _views(self):
        bs, h, c = self._bs, self.num_kv_heads, self._num_cols
        n = bs * h * c
        return (self._scores_buf[:n].view(bs, h, c), self._sorted_buf[:n].view(bs, h, c),
                self._order_buf[:n].view(bs, h, c))

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kmin: torch.Tensor,
            kmax: torch.Tensor, kmean: torch.Tensor):
        """One layer of PSA decode.

        Args:
          q: ``[batch, num_qo_heads, head_dim]`` post-RoPE queries.
          k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]`` bf16/fp16.
          kmin, kmax, kmean: ``[num_rows, num_kv_heads, head_dim]`` this layer's block metadata.

        Returns views into the wrapper's buffers (valid until the next run):
          ``o`` ``[batch, num_qo_heads, head_dim]``, ``lse`` ``[batch, num_qo_heads]`` fp32 base 2,
          ``nread`` ``[batch, num_kv_heads]`` int32 blocks read (incl. sink/local).
        """
        bs, cfg = self._bs, self.config
        scores, sorted_scores, order = self._views()
        block_criticality(q, kmin, kmax, kmean, self._block_table_buf[:bs], self._seq_lens_buf[:bs], scores,
                          block_size=self.block_size, sink_blocks=cfg.sink_blocks,
                          local_blocks=cfg.local_blocks, criticality=cfg.criticality,
                          group_reduce=cfg.group_reduce)
        rank_blocks(scores, sorted_scores, order)
        return sparse_decode(
            q, k_buffer, v_buffer, self._req_to_token, self._req_pool_indices_buf[:bs], self._seq_lens_buf[:bs],
            order, self._list_lens_buf[:bs], self._n_forced_buf[:bs], block_size=self.block_size,
            sm_scale=self.sm_scale, epsilon=cfg.epsilon, micro_batch_blocks=cfg.micro_batch_blocks,
            out=self._o_buf[:bs], lse_out=self._lse_buf[:bs], nread_out=self._nread_buf[:bs],
            tile_tokens=self.tile_tokens)

    @property
    def order(self) -> torch.Tensor:
        """``[batch, num_kv_heads, num_cols]`` int64 rank order of the last :meth:`run` (a view)."""
        return self._views()[2]
