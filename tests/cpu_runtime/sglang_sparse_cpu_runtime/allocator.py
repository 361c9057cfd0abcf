"""Pure-torch paged KV slot allocator (SGLang's own launches Triton kernels, which CPU lacks)."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator, alloc_extend_naive
from sglang.srt.utils import get_num_new_pages


class TorchPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Same contract as :class:`PagedTokenToKVPoolAllocator`; alloc paths in torch."""

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens, num_new_pages=None):
        bs = len(prefix_lens)
        if self.need_sort and extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                              prefix_lens=prefix_lens_cpu)
        if num_new_pages > len(self.free_pages):
            return None
        out_indices = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        alloc_extend_naive(prefix_lens_cpu.to(torch.int64), seq_lens_cpu.to(torch.int64),
                           last_loc.to(torch.int64), self.free_pages, out_indices,
                           self.page_size, self.device)
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        bs = len(seq_lens)
        if self.need_sort and bs > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        if num_new_pages > len(self.free_pages):
            return None
        # the new token sits at position seq_len - 1; it opens a page when that is page-aligned
        need_page = ((seq_lens - 1) % self.page_size) == 0
        page_rank = torch.cumsum(need_page.to(torch.int64), 0) - 1
        new_loc = self.free_pages[page_rank.clamp(min=0)] * self.page_size
        out_indices = torch.where(need_page, new_loc, last_loc.to(torch.int64) + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices
