"""Contract (GPU): on a CUDA machine the plugin loads over stock SGLang's CUDA platform — the
test-only CPU runtime stays inert — and SGLang's FlashInfer backend is selectable."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_cuda_platform_is_active_with_the_plugin_loaded():
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.platforms import current_platform

    assert torch.cuda.is_available()
    assert current_platform.is_cuda() and not current_platform.is_out_of_tree()
    import sglang.srt.server_args as sa

    assert sa.ServerArgs.__name__ == "SparseServerArgs"


def test_cpu_runtime_activation_returns_none_on_gpu():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent / "cpu_runtime" / "sglang_sparse_cpu_runtime" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_cpu_runtime_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.activate() is None
    assert "sglang_sparse_cpu_runtime" not in sys.modules or sys.modules["sglang_sparse_cpu_runtime"].activate() is None


def test_flashinfer_is_a_registered_attention_backend():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert "flashinfer" in ATTENTION_BACKENDS
