"""The one statistics helper of every mode: step rows to SGLang, server counters to ``/server_info``,
Prometheus metrics to ``/metrics``.

* :class:`StepRows`: one forward's per-row statistics (a host tensor ``[bs, cols]`` fp32, possibly still
  filling from a non-blocking device->host copy) as SGLang's ``logits_output.customized_info`` value; read on
  first access, which also folds the rows into the server counters (``on_first_read``). A mode declares where
  its rows come from in its spec (:class:`sglang_sparse.mode_spec.StepReport`);
  :mod:`sglang_sparse.api_hooks` carries them for every mode the same way.
* :class:`MetricSet`: Prometheus counters / gauges / histograms of one component, all named
  ``sglang_sparse:<prefix>_<name>`` on one registry (the default registry unless given).
* :func:`ratio`: ``num / den`` or None when ``den`` is 0 (the derived fields of the counters' ``to_dict``).
"""

from __future__ import annotations

from typing import Callable

import torch


def ratio(num: float, den: float) -> float | None:
    """``num / den``, or None when ``den`` is 0 (a fraction of nothing is not reported as 0)."""
    return num / den if den else None


class MetricSet:
    """Prometheus metrics named ``sglang_sparse:<prefix>_<name>`` on one registry (scheduler process,
    ``/metrics`` with ``--enable-metrics``). ``prometheus_client`` is imported only when one is built."""

    def __init__(self, prefix: str, registry=None):
        from prometheus_client import REGISTRY

        self.prefix = prefix
        self.registry = REGISTRY if registry is None else registry

    def name(self, name: str) -> str:
        return f"sglang_sparse:{self.prefix}_{name}"

    def counter(self, name: str, doc: str, labels=()):
        from prometheus_client import Counter

        return Counter(self.name(name), doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, **kwargs):
        from prometheus_client import Gauge

        return Gauge(self.name(name), doc, registry=self.registry, **kwargs)

    def histogram(self, name: str, doc: str, buckets):
        from prometheus_client import Histogram

        return Histogram(self.name(name), doc, registry=self.registry, buckets=buckets)


class StepRows:
    """One forward's step rows as SGLang's ``customized_info`` value: ``rows[i]`` is row i (a tuple).

    ``host`` is a CPU tensor ``[bs, cols]`` fp32 that may still be filling from a non-blocking copy; it is read
    on first access. SGLang reads ``rows[i]`` per request while it processes the batch result, i.e. after its
    own sync on the sampled tokens, which follows the copy on the same stream.
    """

    def __init__(self, host: torch.Tensor, on_first_read: Callable[[list], None] | None = None):
        self._host = host
        self._rows: list | None = None
        self._on_first_read = on_first_read

    def _materialize(self) -> list:
        if self._rows is None:
            self._rows = [tuple(r) for r in self._host.tolist()]
            if self._on_first_read is not None:
                self._on_first_read(self._rows)
        return self._rows

    def __getitem__(self, i: int) -> tuple:
        return self._materialize()[i]

    def __len__(self) -> int:
        return int(self._host.shape[0])
