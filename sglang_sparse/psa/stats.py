"""PSA statistics: per-step rows for each request, server counters, and the per-request summary.

Flow, without a host sync on the hot path:

1. During a forward the PSA backend accumulates, per batch row, on the device: blocks read
   (summed over layers and KV heads), blocks a dense decode reads, the kernel's kept-mass
   estimate (summed over layers and KV heads) and the row's epsilon -> ``[bs, STEP_COLS]``.
2. After ``ModelRunner.forward`` a hook starts one non-blocking device->host copy of that
   tensor and hands it to SGLang as ``logits_output.customized_info[STEP_KEY]`` wrapped in
   :class:`~sglang_sparse.stats.StepRows`. SGLang reads ``rows[i]`` per request while it processes the batch
   result, i.e. after its own sync on the sampled tokens, which follows the copy on the same
   stream. The first read also updates :class:`PsaStats` and the Prometheus counters.
3. SGLang appends ``rows[i]`` to the request's ``meta_info[STEP_KEY]`` (one entry per output
   token); the main process turns that list into :func:`summarize_steps` for the response's
   ``metadata["sparse"]``.

Columns of a step row: ``sparse`` (1 if PSA decoded the row, 2 if the adaptive switch sent the request
dense, 3 for a decode probe step of the switch: the exact result, with the blocks PSA would read in
``blocks_read``; 4 for the prefill row of a request probed at the end of its prefill (the blocks PSA would read
for the prompt's last query); 0 for other dense rows and prefill),
``blocks_read``, ``blocks_total``, ``kept_sum`` (kept-mass estimate summed over layers x KV
heads; equals ``units`` when dense), ``units`` (layers x KV heads), ``epsilon``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sglang_sparse.stats import MetricSet, StepRows, ratio  # noqa: F401 (StepRows: the carrier)

STEP_KEY = "sparse_psa_steps"
STEP_COLS = 6
COL_SPARSE, COL_READ, COL_TOTAL, COL_KEPT, COL_UNITS, COL_EPS = range(STEP_COLS)
# values of the ``sparse`` column: 0 dense (short context, epsilon 1.0, prefill), 1 decoded by PSA, 2 long but decoded
# densely because the adaptive switch (``dense_above``) sent the request dense, 3 a probe step of that switch (every
# block attended, so the result is exact; ``blocks_read`` holds what PSA's stop test reads at the row's epsilon),
# 4 the prefill row of a request probed at the end of its prefill (the stop test run for the prompt's last query)
ROW_SPARSE, ROW_ADAPTIVE_DENSE, ROW_PROBE, ROW_PREFILL_PROBE = 1, 2, 3, 4
PROBE_KINDS = (ROW_PROBE, ROW_PREFILL_PROBE)


@dataclass
class PsaStats:
    """Counters since start-up (``/server_info`` -> ``internal_states[0].sparse.stats``)."""

    sparse_decode_steps: int = 0   # decode batches with at least one PSA-sparse row
    dense_decode_steps: int = 0    # decode batches entirely below min_context (stock dense path)
    dense_graph_steps: int = 0     # of those, replayed from SGLang's stock decode graph
    sparse_rows: int = 0           # (request, decode step) pairs decoded sparsely
    switched_dense_rows: int = 0   # (request, decode step) pairs decoded densely by the adaptive switch
    probe_rows: int = 0            # (request, decode step) pairs of the switch's probe steps (exact result)
    prefill_probes: int = 0        # requests probed at the end of their prefill
    prefill_probe_graph_extends: int = 0  # extend batches with such a probe replayed from SGLang's prefill graph
    probe_blocks_read: int = 0     # blocks PSA's stop test selects on those (what a sparse step would read)
    probe_blocks_total: int = 0
    blocks_read: int = 0           # sum over layers, sparse rows, KV heads
    blocks_total: int = 0          # what dense attention would have read for the same
    kept_sum: float = 0.0          # kept-mass estimate summed over the same units
    kept_units: int = 0
    # the runner's block-metadata report (CUDA runner: rows, rebuilds, shortfalls), read when the stats are
    # reported (never per step)
    reporter: Callable[[], dict] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "reporter"}
        if self.reporter is not None:
            d.update(self.reporter())
        d["read_fraction"] = ratio(self.blocks_read, self.blocks_total)
        d["kept_mass_mean"] = ratio(self.kept_sum, self.kept_units)
        d["probe_read_fraction"] = ratio(self.probe_blocks_read, self.probe_blocks_total)
        return d


class PsaMetrics:
    """Prometheus metrics of the scheduler process (``/metrics`` with ``--enable-metrics``)."""

    def __init__(self, registry=None):
        m = MetricSet("psa", registry)
        mk = m.counter
        self.sparse_steps = mk("sparse_decode_steps", "decode batches with at least one PSA-sparse request")
        self.dense_steps = mk("dense_decode_steps", "decode batches entirely below min_context (dense)")
        self.blocks_read = mk("blocks_read", "KV blocks read by PSA decode (layers x KV heads x requests)")
        self.blocks_total = mk("blocks_dense", "KV blocks a dense decode would have read for the same")
        self.kept_mass = m.histogram(
            "kept_mass", "kept-mass estimate per (request, decode step), mean over layers and KV heads",
            buckets=(0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0))
        self.read_fraction = m.histogram(
            "read_fraction", "fraction of KV blocks read per (request, decode step)", buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0))


def account_rows(rows: Sequence[Sequence[float]], stats: PsaStats, metrics: PsaMetrics | None) -> None:
    """Fold one step's rows (host lists) into the server counters."""
    for r in rows:
        if r[COL_SPARSE] == ROW_ADAPTIVE_DENSE:
            stats.switched_dense_rows += 1
        if r[COL_SPARSE] in PROBE_KINDS:
            stats.probe_rows += int(r[COL_SPARSE] == ROW_PROBE)
            stats.prefill_probes += int(r[COL_SPARSE] == ROW_PREFILL_PROBE)
            stats.probe_blocks_read += int(r[COL_READ])
            stats.probe_blocks_total += int(r[COL_TOTAL])
        if r[COL_SPARSE] != ROW_SPARSE:
            continue
        read, total, kept, units = int(r[COL_READ]), int(r[COL_TOTAL]), float(r[COL_KEPT]), int(r[COL_UNITS])
        stats.sparse_rows += 1
        stats.blocks_read += read
        stats.blocks_total += total
        stats.kept_sum += kept
        stats.kept_units += units
        if metrics is not None:
            metrics.blocks_read.inc(read)
            metrics.blocks_total.inc(total)
            if units:
                metrics.kept_mass.observe(kept / units)
            if total:
                metrics.read_fraction.observe(read / total)


def summarize_steps(steps: Any) -> dict | None:
    """Per-request summary of the step rows in ``meta_info[STEP_KEY]`` (main process)."""
    if not steps:
        return None
    rows = [r for r in steps if r is not None and len(r) == STEP_COLS]
    if not rows:
        return None
    sparse = [r for r in rows if r[COL_SPARSE] == ROW_SPARSE]
    switched = sum(1 for r in rows if r[COL_SPARSE] == ROW_ADAPTIVE_DENSE)
    probes = [r for r in rows if r[COL_SPARSE] in PROBE_KINDS]
    probe_total = sum(int(r[COL_TOTAL]) for r in probes)
    read = sum(int(r[COL_READ]) for r in sparse)
    total = sum(int(r[COL_TOTAL]) for r in sparse)
    kept = sum(float(r[COL_KEPT]) for r in sparse)
    units = sum(int(r[COL_UNITS]) for r in sparse)
    return {
        "mode": "psa",
        "epsilon": round(float(rows[-1][COL_EPS]), 6),  # stored as fp32 in the step rows
        "steps": len(rows),
        "sparse_decode_steps": len(sparse),
        "switched_dense_steps": switched,
        "prefill_probe": any(r[COL_SPARSE] == ROW_PREFILL_PROBE for r in probes),
        "probe_steps": sum(1 for r in probes if r[COL_SPARSE] == ROW_PROBE),
        "probe_read_fraction": sum(int(r[COL_READ]) for r in probes) / probe_total if probe_total else None,
        "blocks_read": read,
        "blocks_total": total,
        "read_fraction": read / total if total else None,
        "kept_mass": kept / units if units else None,
    }
