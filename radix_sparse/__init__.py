"""radix_sparse: per-node sparse metadata for the radix cache and the host
tier (pure torch/python; never imports sglang). Filled in by the mode issues.

  line_store  LoopServe line sets per turn, per layer, per KV head on radix nodes (refcounted,
              split with the node, byte-bounded LRU).
  host_nodes  host-tier entries of evicted radix nodes, addressed by token path (LRU under a byte bound).
  host_pool   host tier (SparseServe): pinned host pool of KV blocks in per-KV-head units, one GPU
              block cache shared by all layers (LRU, PSA's unified pool), unit <-> slot maps, stats.
  host_lines  LoopServe line sets of host-resident nodes (CPU tensors, byte-bounded).
  working_set SparseServe Alg. 1 admission rule (admit).
  working_set_tracker  per-request last-read step of every (layer, KV head, block) unit on the device:
              working set = units read in the last w decode steps.
"""

from .host_pool import (AcquirePlan, CacheFull, GpuBlockCache, HostBlockPool, HostTierConfig, HostTierStats,
                        KVShape)
from .line_store import LineStore, LineStoreConfig, TurnLines
from .working_set import Admission, admit
from .working_set_tracker import WorkingSetTracker

__all__ = ["LineStore", "LineStoreConfig", "TurnLines",
           "HostTierConfig", "KVShape", "HostBlockPool", "GpuBlockCache", "CacheFull", "AcquirePlan",
           "HostTierStats", "WorkingSetTracker", "Admission", "admit"]
