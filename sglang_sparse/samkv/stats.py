"""``--sparse samkv`` server counters: ``/server_info`` -> ``internal_states[0].sparse.samkv`` and ``/metrics``.

Counted once per documents request, in the scheduler, when its composite context is assembled
(:func:`sglang_sparse.samkv.assembly.init_round_hook`): how it went (``status``: assembled, fallback,
recompute, too_short, error; ``fallback_reasons``: why the dense fallback served it, e.g. a document evicted
before its use), the document tokens it carried, the KV tokens kept in the composite and
the tokens recomputed. A streamed request has no ``metadata["sparse"]`` (the OpenAI stream has no
metadata field): these counters are where its figures show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_sparse.stats import MetricSet, ratio

STATUSES = ("assembled", "fallback", "recompute", "too_short", "error")


@dataclass
class SamKVStats:
    """Counters since start-up."""

    requests: int = 0                 # documents requests seen by the scheduler
    by_status: dict = field(default_factory=lambda: {s: 0 for s in STATUSES})
    document_tokens: int = 0          # document tokens of the assembled requests
    kept_tokens: int = 0              # of which kept in their composite context
    recomputed_tokens: int = 0        # tokens recomputed over the composite (samkv, cacheblend)
    fallback_reasons: dict = field(default_factory=dict)  # why requests were served densely, e.g. "document not cached"

    def record(self, result: dict) -> None:
        """Fold one request's assembly result (``samkv_result``) in."""
        status = str(result.get("status"))
        self.requests += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if status in ("fallback", "error"):
            reason = str(result.get("reason") or status)[:80]  # a few fixed strings (and exception types)
            if reason in self.fallback_reasons or len(self.fallback_reasons) < 32:
                self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        if status == "assembled":
            self.document_tokens += int(result.get("document_tokens", 0))
            self.kept_tokens += int(result.get("kept_tokens", 0))
            self.recomputed_tokens += int(result.get("recomputed_tokens", 0))

    def to_dict(self) -> dict:
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}
        d["kv_kept_ratio"] = ratio(self.kept_tokens, self.document_tokens)
        return d


class SamKVMetrics:
    """Prometheus counters of the scheduler process (``--enable-metrics``)."""

    def __init__(self, registry=None):
        m = MetricSet("samkv", registry)
        self.requests = m.counter("requests", "documents requests by assembly status", labels=("status",))
        self.document_tokens = m.counter("document_tokens", "document tokens of assembled requests")
        self.kept_tokens = m.counter("kept_tokens", "document KV tokens kept in assembled composites")
        self.recomputed_tokens = m.counter("recomputed_tokens", "tokens recomputed over assembled composites")

    def record(self, result: dict) -> None:
        status = str(result.get("status"))
        self.requests.labels(status=status).inc()
        if status == "assembled":
            self.document_tokens.inc(int(result.get("document_tokens", 0)))
            self.kept_tokens.inc(int(result.get("kept_tokens", 0)))
            self.recomputed_tokens.inc(int(result.get("recomputed_tokens", 0)))
