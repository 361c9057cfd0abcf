"""LoopServe statistics: per-step rows for each request, server counters, the per-request summary.

Same flow as :mod:`sglang_sparse.psa.stats` (through the shared :class:`~sglang_sparse.stats.StepRows`
carrier): the backend fills one fp32 row per batch row on the device; a hook after
``ModelRunner.forward`` hands the rows to SGLang as ``logits_output.customized_info[STEP_KEY]``
(one non-blocking copy); SGLang appends row ``i`` to the request's ``meta_info[STEP_KEY]`` (one
entry per output token); the first host read also folds the rows into :class:`LoopServeStats`
and the Prometheus counters; the main process turns a request's rows into
:func:`summarize_steps` (response ``metadata["sparse"]``).

Prefill rows are CUMULATIVE over the request's prefill chunks (SGLang reports only the last
chunk's row), so every request's prefill is counted once. Line counts are sums over layers x KV
heads; ``units`` is the number of (layer, KV head, chunk) selections summed into ``covered_sum``.

Columns: ``kind`` (0 dense, 1 sparse prefill, 2 sparse decode), ``v_lines``, ``s_lines``
(selected vertical / slash lines), ``lines_total`` (candidate lines: 2 x context per layer x KV
head), ``covered_sum`` (Alg. 2's lower bound of the covered sampled mass, summed), ``units``,
``reused_lines`` (lines of earlier turns found on the radix path), ``alpha``, ``tokens_read``
and ``tokens_total`` (decode: tokens attended / context, summed over layers x KV heads),
``reselect`` (decode: 1 if the top-B set was re-selected at this step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sglang_sparse.stats import MetricSet, ratio

STEP_KEY = "sparse_loopserve_steps"
STEP_COLS = 11
(COL_KIND, COL_V, COL_S, COL_LTOT, COL_COV, COL_UNITS, COL_REUSED, COL_ALPHA, COL_READ, COL_TTOT,
 COL_RESEL) = range(STEP_COLS)
KIND_DENSE, KIND_PREFILL, KIND_DECODE, KIND_LASTWINDOW = 0, 1, 2, 3  # KIND_LASTWINDOW: a lastwindow decode row


@dataclass
class LoopServeStats:
    """Counters since start-up (``/server_info`` -> ``internal_states[0].sparse.stats``)."""

    sparse_prefills: int = 0        # requests whose prefill ran sparsely (counted at their last chunk)
    dense_prefill_rows: int = 0     # extend rows below min_context (or alpha 1): stock path
    vertical_lines: int = 0         # selected vertical lines, summed over layers x KV heads
    slash_lines: int = 0
    lines_total: int = 0            # candidate lines for the same
    covered_sum: float = 0.0
    covered_units: int = 0
    reused_lines: int = 0           # lines of earlier turns reused from the radix path
    sparse_decode_rows: int = 0     # (request, decode step) pairs decoded sparsely
    decode_tokens_read: int = 0
    decode_tokens_total: int = 0
    reselections: int = 0
    graph_decode_steps: int = 0     # decode steps replayed from a CUDA graph (steady and re-selecting, loopserve.graph)
    graph_select_steps: int = 0     # of those, re-selecting steps (the re-selecting graph variant)
    dense_graph_steps: int = 0      # decode steps without a sparse row replayed from SGLang's stock graph
    stored_turns: int = 0           # turns whose lines were attached to a radix node
    line_store_bytes: int = 0       # bytes held by the line store now

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["covered_mass_mean"] = ratio(self.covered_sum, self.covered_units)
        d["line_fraction"] = ratio(self.vertical_lines + self.slash_lines, self.lines_total)
        d["decode_read_fraction"] = ratio(self.decode_tokens_read, self.decode_tokens_total)
        return d


class LoopServeMetrics:
    """Prometheus metrics of the scheduler process (``/metrics`` with ``--enable-metrics``)."""

    def __init__(self, registry=None):
        m = MetricSet("loopserve", registry)
        mk = m.counter
        self.sparse_prefills = mk("sparse_prefills", "requests whose prefill ran sparse (vertical/slash lines)")
        self.vertical_lines = mk("vertical_lines", "vertical lines selected (layers x KV heads x requests)")
        self.slash_lines = mk("slash_lines", "slash lines selected (layers x KV heads x requests)")
        self.lines_total = mk("lines_candidate", "candidate lines for the same (2 x context x layers x KV heads)")
        self.reused_lines = mk("reused_lines", "lines of earlier turns reused from radix nodes")
        self.decode_rows = mk("sparse_decode_rows", "(request, decode step) pairs decoded sparsely")
        self.tokens_read = mk("decode_tokens_read", "tokens attended by sparse decode (layers x KV heads)")
        self.tokens_total = mk("decode_tokens_dense", "tokens a dense decode would have attended for the same")
        self.reselections = mk("reselections", "progressive top-B re-selections (Alg. 3)")
        self.stored_turns = mk("stored_turns", "turns whose lines were attached to a radix node")
        self.store_bytes = m.gauge("line_store_bytes", "bytes of stored turn lines")
        self.covered = m.histogram(
            "covered_mass", "covered sampled attention mass per request prefill "
            "(lower bound, mean over layers and KV heads)",
            buckets=(0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0))


def account_rows(rows: Sequence[Sequence[float]], stats: LoopServeStats, metrics: LoopServeMetrics | None) -> None:
    """Fold one step's rows (host lists) into the server counters."""
    for r in rows:
        kind = int(r[COL_KIND])
        if kind == KIND_PREFILL:
            v, s, tot, units = int(r[COL_V]), int(r[COL_S]), int(r[COL_LTOT]), int(r[COL_UNITS])
            cov, reused = float(r[COL_COV]), int(r[COL_REUSED])
            stats.sparse_prefills += 1
            stats.vertical_lines += v
            stats.slash_lines += s
            stats.lines_total += tot
            stats.covered_sum += cov
            stats.covered_units += units
            stats.reused_lines += reused
            if metrics is not None:
                metrics.sparse_prefills.inc()
                metrics.vertical_lines.inc(v)
                metrics.slash_lines.inc(s)
                metrics.lines_total.inc(tot)
                metrics.reused_lines.inc(reused)
                if units:
                    metrics.covered.observe(cov / units)
        elif kind in (KIND_DECODE, KIND_LASTWINDOW):
            read, tot, resel = int(r[COL_READ]), int(r[COL_TTOT]), int(r[COL_RESEL])
            stats.sparse_decode_rows += 1
            stats.decode_tokens_read += read
            stats.decode_tokens_total += tot
            stats.reselections += resel
            if metrics is not None:
                metrics.decode_rows.inc()
                metrics.tokens_read.inc(read)
                metrics.tokens_total.inc(tot)
                metrics.reselections.inc(resel)
        else:
            stats.dense_prefill_rows += 0  # dense rows carry no counters


def summarize_steps(steps: Any) -> dict | None:
    """Per-request summary of the step rows in ``meta_info[STEP_KEY]`` (main process)."""
    if not steps:
        return None
    rows = [r for r in steps if r is not None and len(r) == STEP_COLS]
    if not rows:
        return None
    pre = [r for r in rows if int(r[COL_KIND]) == KIND_PREFILL]
    dec = [r for r in rows if int(r[COL_KIND]) in (KIND_DECODE, KIND_LASTWINDOW)]
    p = pre[-1] if pre else None
    units = int(p[COL_UNITS]) if p else 0
    read = sum(int(r[COL_READ]) for r in dec)
    ttot = sum(int(r[COL_TTOT]) for r in dec)
    return {
        "mode": "lastwindow" if any(int(r[COL_KIND]) == KIND_LASTWINDOW for r in dec) else "loopserve",
        "alpha": round(float(rows[0][COL_ALPHA]), 6),
        "steps": len(rows),
        "sparse_prefill": p is not None,
        "vertical_lines": int(p[COL_V]) if p else 0,
        "slash_lines": int(p[COL_S]) if p else 0,
        "lines_total": int(p[COL_LTOT]) if p else 0,
        "line_fraction": (int(p[COL_V]) + int(p[COL_S])) / int(p[COL_LTOT]) if p and p[COL_LTOT] else None,
        "covered_mass": float(p[COL_COV]) / units if units else None,
        "reused_lines": int(p[COL_REUSED]) if p else 0,
        "sparse_decode_steps": len(dec),
        "decode_tokens_read": read,
        "decode_tokens_total": ttot,
        "decode_read_fraction": read / ttot if ttot else None,
        "reselections": sum(int(r[COL_RESEL]) for r in dec),
    }
