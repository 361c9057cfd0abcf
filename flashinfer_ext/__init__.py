"""Kernels and their torch fp32 references for sparse attention (no sglang import, ever).

Sub-packages, one per algorithm (one concept per module):
  psa/        PSA decode: config (PsaDecodeConfig), block_meta (per-block key min/max/mean), criticality
              (cuboid / mean block scores), rank_select (partial ranking), chunks (split-K over the ranked
              list + host wave plan), wave_merge (merge with the stop test on the GPU), decode
              (PsaDecodeWrapper: plan() once per batch, run() per layer, CUDA-graph capturable).
  loopserve/  LoopServe: vs_estimate / vs_estimate_batched / vs_lse_split / vs_common (vertical/slash line
              sums from sampled query rows), vs_select / vs_split_search (alpha-coverage line selection and
              decode top-B, no host sync), vs_prefill (sparse prefill over lines + sink + local window),
              list_union (decode-list union), decode (VerticalSlashDecode: plan() once per step, run()
              per layer over the step's token lists), reference (pure-torch fp32 references).
  samkv/      SamKV: score (block scoring), rope_shift (re-rotate cached keys by a RoPE position delta).
  host_tier/  SparseServe host tier: host_transfer (fused UVA gather, FlashH2D; CPU-assisted save, FlashD2H),
              kv_units (KV pages <-> host units), ws_record (working-set records).
  common/     shared by the modes: tile_attention (list-driven decode tile), sparse_decode / split_decode
              (decode over per-(request, KV head) lists), merge (base-2 log-sum-exp merge), dense_decode
              (FlashInfer dense decode helper), reference (pure-torch fp32 references).

Kernel modules import Triton at import time; on a CPU machine set ``TRITON_INTERPRET=1``
before importing them. FlashInfer is only imported lazily, on CUDA paths.
"""

from .psa.config import PsaDecodeConfig

__all__ = ["PsaDecodeConfig"]
