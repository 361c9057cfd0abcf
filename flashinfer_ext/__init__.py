"""Kernels and their torch fp32 references for sparse attention (no sglang import, ever).

Modules (one concept each):
  config        PsaDecodeConfig: frozen, validated knobs of PSA decode.
  block_meta    per-block, per-KV-head key min/max (cuboid) and mean, kept current (Triton).
  criticality   cuboid / mean block scores per (request, KV head), explicit GQA group (Triton) + device sort.
  sparse_decode decode over per-(request, KV head) block lists with the PSA stop test on the GPU
                (Triton); the sparse-page primitive shared with LoopServe decode.
  psa_decode    PsaDecodeWrapper: plan() once per batch, run() per layer, CUDA-graph capturable.
  merge         base-2 log-sum-exp state merge (flashinfer.merge_state on CUDA, torch elsewhere).
  reference     pure-torch fp32 references of all of the above.

Kernel modules import Triton at import time; on a CPU machine set ``TRITON_INTERPRET=1``
before importing them. FlashInfer is only imported lazily, on CUDA paths.
"""

from .config import PsaDecodeConfig

__all__ = ["PsaDecodeConfig"]
