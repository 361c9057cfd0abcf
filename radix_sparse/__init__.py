"""radix_sparse: per-node sparse metadata for the radix cache, document entries and the host
tier (pure torch/python; never imports sglang). Filled in by the mode issues.

  line_store  LoopServe line sets per turn, per layer, per KV head on radix nodes (refcounted,
              split with the node, byte-bounded LRU).
  doc_store   SamKV per-document KV entries keyed by (token-id hash, cache_salt): refcounted,
              byte-bounded LRU among unreferenced entries.
"""

from .doc_store import DocEntry, DocKey, DocStore, DocStoreConfig, DocStoreStats, doc_key
from .line_store import LineStore, LineStoreConfig, TurnLines

__all__ = ["LineStore", "LineStoreConfig", "TurnLines",
           "DocStore", "DocStoreConfig", "DocStoreStats", "DocKey", "DocEntry", "doc_key"]
