"""flashinfer_ext kernel tests: run Triton under the CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported; this conftest is loaded
before the test modules of this folder import the kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine Triton compiles for the GPU, so the CPU-interpreter tests of this folder
    (CPU tensors, not marked ``gpu``) are skipped there; they run on the CPU machine."""
    if not torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="CPU Triton-interpreter test; runs on the CPU machine")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "gpu" not in item.keywords:
            item.add_marker(skip)
