"""PSA's adaptive switch (``dense_above``, ``probe_steps``): which requests keep decoding through PSA.

State lives on SGLang's scheduler ``Req`` objects (host only, no device access): the decision (a bool) once made,
the running probe tally before, and a marker for requests probed at the end of their prefill. The runner
(:mod:`sglang_sparse.psa.runner`) asks :func:`switch_state` per batch and :func:`extend_probe_rows` per extend.
"""

from __future__ import annotations

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.stats import (COL_READ, COL_SPARSE, COL_TOTAL, ROW_PREFILL_PROBE, ROW_PROBE, ROW_SPARSE, STEP_COLS,
                                     STEP_KEY)
from sglang_sparse.request_params import batch_requests, request_values

_PROBE_ATTR = "_sparse_psa_probe"  # on a scheduler ``Req``: (rows scanned, sparse rows, read, total) or the decision
_PREFILL_PROBE_ATTR = "_sparse_psa_prefill_probe"  # on a ``Req``: probed at the end of its prefill (decode densely
                                                   # until the decision is read back)
_EPS_ATTR = "_sparse_psa_eps"  # on a ``Req``: its epsilon, read once from its custom_params


def adaptive_dense(cfg: PsaConfig, req) -> bool:
    """The adaptive switch (``dense_above``, ``probe_steps``): whether ``req`` decodes densely from now on.

    Reads the request's own step rows (``req.customized_info[STEP_KEY]``, host tuples SGLang appends after each
    step; one step behind under the overlap scheduler), incrementally: a prefill probe row decides at once; otherwise,
    once ``probe_steps`` probe (or sparse) rows are seen, the request switches to dense for good if PSA read, or
    would have read, more than ``dense_above`` of their blocks. The decision
    (a bool) is kept on the ``Req``, so later steps cost one attribute read. No device access.
    """
    if req is None or cfg.dense_above >= 1.0:
        return False
    state = getattr(req, _PROBE_ATTR, None)
    if isinstance(state, bool):
        return state
    info = getattr(req, "customized_info", None)
    rows = info.get(STEP_KEY) if isinstance(info, dict) else None
    if not rows:
        return False
    seen, n, read, total = state if state is not None else (0, 0, 0.0, 0.0)
    for r in rows[seen:]:
        seen += 1
        if r is not None and len(r) == STEP_COLS and r[COL_SPARSE] == ROW_PREFILL_PROBE:
            decided = r[COL_TOTAL] > 0 and float(r[COL_READ]) / float(r[COL_TOTAL]) > cfg.dense_above
            setattr(req, _PROBE_ATTR, decided)
            return decided
        if r is not None and len(r) == STEP_COLS and r[COL_SPARSE] in (ROW_PROBE, ROW_SPARSE):
            n, read, total = n + 1, read + float(r[COL_READ]), total + float(r[COL_TOTAL])
            if n >= cfg.probe_steps:
                decided = total > 0 and read / total > cfg.dense_above
                setattr(req, _PROBE_ATTR, decided)
                return decided
    setattr(req, _PROBE_ATTR, (seen, n, read, total))
    return False


def _epsilon_of(cfg: PsaConfig, req) -> float:
    """A request's epsilon (:func:`sglang_sparse.request_params.request_values`), read once and kept on the ``Req``
    (its options never change); the server's ``epsilon`` for a row without a request."""
    if req is None:
        return float(cfg.epsilon)
    eps = getattr(req, _EPS_ATTR, None)
    if eps is None:
        eps = float(request_values(cfg, req)["epsilon"])
        setattr(req, _EPS_ATTR, eps)
    return eps


def _epsilons_of(cfg: PsaConfig, reqs, bs: int) -> list[float]:
    """Each of ``bs`` rows' epsilon (:func:`_epsilon_of`)."""
    reqs = reqs or ()
    return [_epsilon_of(cfg, reqs[i] if i < len(reqs) else None) for i in range(bs)]


def _decided(req) -> bool:
    return req is not None and isinstance(getattr(req, _PROBE_ATTR, None), bool)


def switch_state(cfg: PsaConfig, reqs, bs: int, lens=None) -> tuple[list[bool], list[bool]]:
    """Each of ``bs`` rows' adaptive-switch state: ``(dense, probing)`` (:func:`adaptive_dense`). ``dense``: sent
    dense, or probed at the end of its prefill and not decided yet (a stock step while the decision is on its way);
    ``probing``: undecided without a prefill probe (a decode probe step). Rows without a request are neither.
    ``lens`` (host ints): rows below ``min_context`` are neither without reading their request (the switch
    applies to long rows only), so a batch of short rows costs no per-request work."""
    reqs = reqs or ()
    n = min(bs, len(reqs))
    long = [True] * n if lens is None else [int(lens[i]) >= cfg.min_context for i in range(n)]
    off = [adaptive_dense(cfg, reqs[i]) if i < n and long[i] else False for i in range(bs)]
    if cfg.dense_above >= 1.0:
        return off, [False] * bs
    probe = [False] * bs
    for i in range(n):
        req = reqs[i]
        if not long[i] or req is None or _decided(req):
            continue
        if getattr(req, _PREFILL_PROBE_ATTR, False):
            off[i] = True
        else:
            probe[i] = True
    return off, probe


def extend_probe_rows(cfg: PsaConfig, forward_batch) -> list[int]:
    """Rows of an extend batch probed at the end of their prefill: the switch is on (``dense_above`` < 1), the
    row's request is undecided, its epsilon < 1, and this extend writes its last prompt token at a context of
    at least ``min_context``. Host reads only (the prefill-graph gate asks it before the batch is planned)."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    if cfg.dense_above >= 1.0 or lens is None or getattr(forward_batch, "extend_seq_lens_cpu", None) is None:
        return []
    bs = int(forward_batch.batch_size)
    reqs = list(batch_requests(forward_batch) or ())[:bs]
    eps = _epsilons_of(cfg, reqs, len(reqs))
    rows = []
    for i, req in enumerate(reqs):
        n = int(lens[i])
        if req is None or eps[i] >= 1.0 or n < cfg.min_context or _decided(req):
            continue
        full = len(getattr(req, "origin_input_ids", None) or ()) + len(getattr(req, "output_ids", None) or ())
        if n >= full:  # the prompt's last chunk (an earlier chunk of a chunked prefill is not probed)
            rows.append(i)
    return rows
