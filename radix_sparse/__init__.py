"""radix_sparse: per-node sparse metadata for the radix cache, document entries and the host
tier (pure torch/python; never imports sglang). Filled in by the mode issues.

  line_store  LoopServe line sets per turn, per layer, per KV head on radix nodes (refcounted,
              split with the node, byte-bounded LRU).
"""

from .line_store import LineStore, LineStoreConfig, TurnLines

__all__ = ["LineStore", "LineStoreConfig", "TurnLines"]
