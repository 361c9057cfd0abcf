"""flashinfer_ext kernel tests: run Triton under the CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported; this conftest is loaded
before the test modules of this folder import the kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
