"""Kernels and their torch fp32 references for sparse attention (no sglang import, ever).

Modules (one concept each):
  config        PsaDecodeConfig: frozen, validated knobs of PSA decode (estimator, chunk schedule, caps).
  block_meta    per-block, per-KV-head key min/max (cuboid) and mean, kept current (Triton).
  criticality   cuboid / mean block scores per (request, KV head), explicit GQA group (Triton).
  rank_select   partial ranking: exact top-K prefix + block-order tail, one launch (Triton).
  psa_chunks    PSA split-K over the ranked list: chunk partials and the host wave plan (Triton).
  wave_merge    merge of a wave's chunk partials in rank order with the stop test on the GPU (Triton).
  psa_decode    PsaDecodeWrapper: plan() once per batch, run() per layer, CUDA-graph capturable.
  sparse_decode decode over per-(request, KV head) block/token lists in one launch (Triton); the
                sparse-page primitive LoopServe decode uses (block_size 1).
  vs_estimate   LoopServe vertical/slash line sums from sampled query rows (Triton).
  vs_select     LoopServe alpha-coverage line selection and decode top-B (torch, no host sync).
  vs_prefill    LoopServe sparse prefill over selected lines + sink + local window (Triton).
  rope_shift    re-rotate cached keys by a RoPE position delta (SamKV document reuse; Triton).
  host_transfer host tier transfers: fused gather of many host rows through UVA (one Triton launch,
                FlashH2D) and CPU-assisted saving (one D2H copy + thread scatter, FlashD2H).
  kv_units      SGLang token-major KV pages <-> host-tier units (all layers, unit-id order; torch).
  dense_decode  FlashInfer dense decode helper (benchmarks, tests).
  merge         base-2 log-sum-exp state merge (flashinfer.merge_state on CUDA, torch elsewhere).
  reference, loopserve_reference   pure-torch fp32 references of the above.

Kernel modules import Triton at import time; on a CPU machine set ``TRITON_INTERPRET=1``
before importing them. FlashInfer is only imported lazily, on CUDA paths.
"""

from .config import PsaDecodeConfig

__all__ = ["PsaDecodeConfig"]
