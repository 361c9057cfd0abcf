"""The one statistics helper of every mode: step rows to SGLang, server counters to ``/server_info``,
Prometheus metrics to ``/metrics``.

* :class:`StepRows`: one forward's per-row statistics (a host tensor ``[bs, cols]`` fp32, possibly still
  filling from a non-blocking device->host copy) as SGLang's ``logits_output.customized_info`` value; read on
  first access, which also folds the rows into the server counters (``on_first_read``). A mode declares where
  its rows come from in its spec (:class:`sglang_sparse.mode_spec.StepReport`);
  :mod:`sglang_sparse.api_hooks` carries them for every mode the same way.
* :class:`DenseRowCache`: the step rows of a batch the mode left to the stock decode (no sparse row), built from
  host values only and shared between such steps (no tensor, no copy, nothing to fold into the counters).
* :class:`MetricSet`: Prometheus counters / gauges / histograms of one component, all named
  ``sglang_sparse:<prefix>_<name>`` on one registry (the default registry unless given).
* :func:`host_row`: one step row as a host tuple (the rows :class:`DenseRowCache` shares).
* :func:`ratio`: ``num / den`` or None when ``den`` is 0 (the derived fields of the counters' ``to_dict``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def host_row(num_cols: int, values: dict[int, float]) -> tuple:
    """A step row as a host tuple of ``num_cols`` floats: ``values`` (column -> value) set, every other column 0."""
    row = [0.0] * num_cols
    for col, v in values.items():
        row[col] = float(v)
    return tuple(row)


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
    (and folded into the counters by ``on_first_read``) on first access. ``rows`` instead: host tuples already
    final, folded at construction. SGLang reads ``rows[i]`` per request while it processes the batch result, i.e.
    after its own sync on the sampled tokens, which follows the copy on the same stream.
    """

    def __init__(self, host: torch.Tensor | None, on_first_read: Callable[[list], None] | None = None,
                 rows: Sequence[tuple] | None = None):
        """``host`` ``[bs, cols]`` fp32 (CPU), or ``rows`` (host tuples, already final) instead."""
        if (host is None) == (rows is None):
            raise ValueError("StepRows takes exactly one of host (a [bs, cols] CPU tensor) and rows (host tuples)")
        self._host = host
        self._rows: list | None = None if rows is None else list(rows)
        self._on_first_read = on_first_read
        if rows is not None and on_first_read is not None:
            on_first_read(self._rows)

    def _materialize(self) -> list:
        if self._rows is None:
            self._rows = [tuple(r) for r in self._host.tolist()]
            if self._on_first_read is not None:
                self._on_first_read(self._rows)
        return self._rows

    def __getitem__(self, i: int) -> tuple:
        return self._materialize()[i]

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else int(self._host.shape[0])


class DenseRowCache:
    """Step rows of decode batches that run the stock decode, shared between steps.

    Such a batch's rows carry only host values the mode already knows (a row kind and the request's option, e.g.
    psa's epsilon or loopserve's alpha), so a step needs no tensor and no device copy: :meth:`rows` returns one
    :class:`StepRows` per distinct tuple of rows, built once. Only rows that fold nothing into the server counters
    may be shared (a kind the counters count needs a fresh :class:`StepRows` with its callback per step). At most
    ``max_entries`` distinct batches are kept (the oldest is dropped first).
    """

    def __init__(self, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"DenseRowCache max_entries={max_entries} must be >= 1")
        self.max_entries = max_entries
        self._cache: dict[tuple, StepRows] = {}

    def rows(self, rows: tuple[tuple[float, ...], ...]) -> StepRows:
        """The shared :class:`StepRows` of ``rows`` (one tuple per batch row, final values)."""
        got = self._cache.get(rows)
        if got is None:
            if len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
            got = self._cache[rows] = StepRows(None, rows=rows)
        return got

    def __len__(self) -> int:
        return len(self._cache)
