"""Test-only CPU runtime: an out-of-tree SGLang platform for machines without a GPU.

Stock SGLang 0.5.17 cannot serve on this project's CPU CI box as shipped: ``--device cpu``
reaches ``vllm._custom_ops`` through the rotary embedding, and SGLang's own CPU engine
needs a CPU build of ``sgl_kernel`` that PyPI lacks. This plugin (entry point group
``sglang.srt.platforms``) supplies a platform whose ops dispatch to ``forward_native``,
whose default attention backend is ``torch_native``, and whose allocators are pure torch.

It is installed only into the CPU test environment (``scripts/setup_cpu_env.sh``) and
is inert whenever CUDA is available: :func:`activate` then returns ``None`` and SGLang
picks its CUDA platform as usual.
"""

from __future__ import annotations

import torch

PLATFORM_QUALNAME = "sglang_sparse_cpu_runtime.platform.SparseCpuTestPlatform"


def activate() -> str | None:
    """Entry point of group ``sglang.srt.platforms``; None (inactive) when a GPU is present."""
    if torch.cuda.is_available():
        return None
    return PLATFORM_QUALNAME
