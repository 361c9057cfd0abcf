"""Dense paged decode through FlashInfer (the dense fallback and the benchmark baseline).

Supports: SGLang's KV pool viewed as FlashInfer NHD pages ``[num_pages, page_size,
num_kv_heads, head_dim]`` (page size >= 1), page tables built on the device from
``req_to_token`` (``indptr / indices / last_page_len``), ``return_lse`` (BASE 2).
Optionally a sparse page table: any subset of each request's pages, shared by all
KV heads (FlashInfer cannot take a per-KV-head list; that is what
:mod:`flashinfer_ext.common.sparse_decode` is for).

Cautions: flashinfer is imported lazily (absent on CPU machines); plan() syncs the
host (page-table sizes), so call it once per batch, never per layer.
"""

from __future__ import annotations

import torch

__all__ = ["paged_kv_table", "FlashInferDenseDecode"]


def paged_kv_table(req_to_token: torch.Tensor, req_pool_indices, seq_lens_host, page_size: int):
    """``(indptr [batch+1], indices [nnz], last_page_len [batch])`` int32 on req_to_token's device."""
    dev = req_to_token.device
    indptr, chunks, last = [0], [], []
    for rpi, L in zip([int(x) for x in req_pool_indices], [int(x) for x in seq_lens_host]):
        n = -(-L // page_size)
        pos = torch.arange(n, device=dev) * page_size
        chunks.append(req_to_token[rpi, pos].long() // page_size)
        indptr.append(indptr[-1] + n)
        last.append(L - (n - 1) * page_size)
    return (torch.tensor(indptr, dtype=torch.int32, device=dev), torch.cat(chunks).to(torch.int32),
            torch.tensor(last, dtype=torch.int32, device=dev))


class FlashInferDenseDecode:
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` over SGLang's pool layout."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device="cuda", workspace_bytes: int = 128 << 20, use_tensor_cores: bool | None = None):
        import flashinfer  # lazy

        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = (
            num_qo_heads, num_kv_heads, head_dim, page_size)
        self._workspace_buf = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        if use_tensor_cores is None:
            use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace_buf, "NHD", use_tensor_cores=use_tensor_cores)

    def plan(self, indptr, indices, last_page_len, *, dtype=torch.bfloat16, sm_scale=None):
        self._wrapper.plan(indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads,
                           self.head_dim, self.page_size, pos_encoding_mode="NONE",
                           q_data_type=dtype, kv_data_type=dtype,
                           sm_scale=self.head_dim ** -0.5 if sm_scale is None else sm_scale)

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor):
        """``q`` ``[batch, num_qo_heads, head_dim]``; pools ``[num_slots, num_kv_heads, head_dim]``.

        Returns ``(o [batch, num_qo_heads, head_dim], lse [batch, num_qo_heads] fp32 base 2)``.
        """
        p = self.page_size
        shape = (k_buffer.shape[0] // p, p, self.num_kv_heads, self.head_dim)
        return self._wrapper.run(q, (k_buffer.view(shape), v_buffer.view(shape)), return_lse=True)
