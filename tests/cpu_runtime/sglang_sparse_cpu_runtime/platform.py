"""The CPU platform class (imported by SGLang only after :func:`activate` chose it).

SGLang resolves the platform while ``sglang.srt.utils`` is still importing, so this module
imports only ``sglang.srt.platforms.*`` at top level; everything else is imported lazily.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum


class SparseCpuTestPlatform(CpuSRTPlatform):
    """CPU platform for tests: native ops, ``torch_native`` attention, plain KV pool."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_mha_kv_pool_cls(self) -> type:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        return MHATokenToKVPool

    def get_paged_allocator_cls(self) -> type:
        return _allocator_factory

    def support_cuda_graph(self) -> bool:
        return False

    def support_piecewise_cuda_graph(self) -> bool:
        return False

    def get_torch_profiler_activity_str(self) -> str:  # SGLang's /start_profile (bench/decode_profile.py)
        return "CPU"

    def get_torch_profiler_activity(self):
        import torch

        return torch.profiler.ProfilerActivity.CPU


def _allocator_factory(size, *, page_size, dtype, device, kvcache, need_sort):
    """SGLang asks an out-of-tree platform for one allocator class for every page size."""
    if page_size == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        return TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort)
    from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator

    return TorchPagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort)
