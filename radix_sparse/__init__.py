"""radix_sparse: per-node sparse metadata for the radix cache and the host
tier (pure torch/python; never imports sglang). Filled in by the mode issues.

  line_store  LoopServe line sets per turn, per layer, per KV head on radix nodes (refcounted,
              split with the node, byte-bounded LRU).
  host_nodes  host-tier entries of evicted radix nodes, addressed by token path (LRU under a byte bound).
  host_pool   host tier (SparseServe): pinned host pool of KV blocks in per-KV-head units, one GPU
              block cache shared by all layers (LRU, PSA's unified pool), unit <-> slot maps, stats.
  working_set per-request union of the units selected in the last w steps; Alg. 1 admission.
"""

from .host_pool import (AcquirePlan, CacheFull, GpuBlockCache, HostBlockPool, HostTierConfig, HostTierStats,
                        KVShape)
from .line_store import LineStore, LineStoreConfig, TurnLines
from .working_set import Admission, WorkingSetEstimator, admit

__all__ = ["LineStore", "LineStoreConfig", "TurnLines",
           "HostTierConfig", "KVShape", "HostBlockPool", "GpuBlockCache", "CacheFull", "AcquirePlan",
           "HostTierStats", "WorkingSetEstimator", "Admission", "admit"]
