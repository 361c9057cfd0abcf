"""Working-set-aware admission in SGLang's scheduler (SparseServe §3.3, Alg. 1).

Under ``--sparse psa`` or ``--sparse loopserve`` with the host tier (``host_tier_gb > 0``) and
``working_set_admission`` (default on), a waiting request joins the running batch only while the summed
working sets fit the GPU unit cache (``gpu_cache_mb``, in units of one (layer, KV page, KV head) of K and V):

  * a running request's working set = the units its sparse decode read in its last ``working_set_window``
    steps (:class:`radix_sparse.working_set_tracker.WorkingSetTracker`, recorded on the device by the PSA
    runner, or by the LoopServe runner through :mod:`sglang_sparse.loopserve.ws`); a running request that is
    not tracked (no free slot, no sparse step yet, or decoding densely) counts its whole context;
  * a waiting request's estimate = its prompt's units x the running tracked requests' mean
    working-set fraction (1.0 while nothing is tracked, and for prompts below ``min_context``, which
    decode densely);
  * the waiting requests are taken in queue order while the sum fits (stop at the first that does
    not: :func:`radix_sparse.working_set.admit`, Alg. 1); when nothing is running, the first is always
    admitted (progress: an oversize request runs alone rather than starving).

The mode's attention backend names its tracker in ``backend.sparse_working_set`` (a :class:`WorkingSetSource`:
tracker, block size in tokens, ``min_context``), set at install by :mod:`sglang_sparse.psa.backend` and
:mod:`sglang_sparse.loopserve.backend` when the tracker exists.

How it plugs in (two hooks, listed in :mod:`sglang_sparse.plugin`): AROUND ``Scheduler.get_new_batch_prefill`` computes this
pass's allowance (how many waiting requests may join) before the stock code runs and clears it
after; AFTER ``Scheduler.get_num_allocatable_reqs`` caps the stock count with it, so SGLang's own
``PrefillAdder`` loop, budgets and bookkeeping stay in charge: a request held back simply stays in the
waiting queue (never dropped, no KV slot touched, SGLang's idle leak check unaffected). A chunked
prefill in progress is never held back. When the allowance is 0 the stock code marks the batch full;
this module clears that mark again after ``working_set_window`` scheduler passes, so the decision is
re-taken as working sets change (or earlier, when a request finishes: stock behaviour).

Host sync: :meth:`WorkingSetTracker.sizes` copies the running requests' sizes to the host once per
decision, i.e. only in scheduler passes with a waiting request (and, under pressure, once every
``working_set_window`` passes); never per layer, never in a pass with an empty queue.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from radix_sparse.working_set import admit

logger = logging.getLogger("sglang_sparse")



@dataclass(frozen=True)
class WorkingSetSource:
    """What a mode's backend exposes to the admission (``backend.sparse_working_set``): its tracker, the tracker's
    block in tokens (PSA: its block; LoopServe: the KV page) and the context below which it decodes densely."""

    tracker: object
    block_size: int
    min_context: int

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"WorkingSetSource.block_size={self.block_size} is out of range: expected >= 1")
        if self.min_context < 0:
            raise ValueError(f"WorkingSetSource.min_context={self.min_context} is out of range: expected >= 0")


@dataclass
class AdmissionStats:
    """Counters since start-up (``/server_info`` -> ``internal_states[0].sparse.working_set``)."""

    decisions: int = 0          # scheduler passes that computed an allowance
    limited: int = 0            # ... of which held back at least one waiting request
    held_requests: int = 0      # waiting requests held back, summed over those passes
    oversize_admissions: int = 0  # a request admitted alone although its estimate exceeds the cache
    capacity_units: int = 0
    running_units: int = 0      # summed working sets of the running requests at the last decision
    tracked_requests: int = 0   # running requests with a measured working set at the last decision
    working_set_fraction: float | None = None  # their mean working set / context units
    measured_decisions: int = 0  # decisions that used at least one measured working set
    working_set_fraction_sum: float = 0.0  # working_set_fraction summed over the measured decisions
    # (a client's mean over an interval = delta of this sum / delta of measured_decisions)
    peak_planned_units: int = 0  # largest running + admitted estimate of a decision that was not oversize


class AdmissionMetrics:
    """Prometheus metrics (``/metrics`` with ``--enable-metrics``)."""

    def __init__(self, registry=None):
        from sglang_sparse.stats import MetricSet

        m = MetricSet("ws", registry)
        self.limited = m.counter("admission_limited", "scheduler passes in which working-set admission held back "
                                 "waiting requests")
        self.held = m.counter("admission_held_requests", "waiting requests held back by working-set admission "
                              "(summed over passes)")
        self.running_units = m.gauge("running_units", "summed working sets (units) of the running requests at "
                                     "the last admission decision", multiprocess_mode="mostrecent")
        self.capacity_units = m.gauge("capacity_units", "GPU unit cache capacity (units) the working sets must fit",
                                      multiprocess_mode="mostrecent")


class WorkingSetAdmission:
    """The scheduler's admission policy object (one per scheduler process; see the module docstring)."""

    def __init__(self, tracker, *, capacity_units: int, units_per_block: int, block_size: int, min_context: int,
                 metrics: AdmissionMetrics | None = None) -> None:
        if capacity_units < 1:
            raise ValueError(f"capacity_units={capacity_units} must be >= 1")
        self.tracker = tracker
        self.capacity, self.units_per_block, self.block_size = int(capacity_units), int(units_per_block), block_size
        self.min_context = int(min_context)
        self.window = int(tracker.window)
        self.stats = AdmissionStats(capacity_units=self.capacity)
        self.metrics = metrics
        if metrics is not None:
            metrics.capacity_units.set(self.capacity)
        self.allowance: int | None = None  # set during one get_new_batch_prefill pass
        self._full_by_us = False
        self._passes_since = 0

    def units(self, num_tokens: int) -> int:
        return self.units_per_block * -(-int(num_tokens) // self.block_size)

    def report(self) -> dict:
        return dict(self.stats.__dict__, window=self.window, tracked_slots=self.tracker.num_slots)

    # ------------------------------------------------------------------ one scheduler pass
    def begin_pass(self, scheduler, running_batch) -> None:
        self.allowance = None
        waiting = list(scheduler.waiting_queue)
        if not waiting or scheduler.chunked_req is not None:
            return
        if running_batch.batch_is_full and self._full_by_us:
            self._passes_since += 1
            if self._passes_since < self.window:
                return  # still full by our last decision: the stock code returns early
            running_batch.batch_is_full = False  # re-take the decision
        self._full_by_us = False
        running = [r for r in running_batch.reqs if not r.finished()]
        sizes = self.tracker.sizes([r.rid for r in running]) if running else []
        used, tracked_units, tracked_ctx = 0, 0, 0
        for req, size in zip(running, sizes):
            ctx = self.units(len(req.origin_input_ids) + len(req.output_ids))
            if size is None:
                used += ctx
            else:
                used += size
                tracked_units += size
                tracked_ctx += ctx
        frac = min(1.0, tracked_units / tracked_ctx) if tracked_ctx else None
        running_used = used
        ests = []
        for req in waiting:
            n = len(req.origin_input_ids)
            est = self.units(n)
            ests.append(math.ceil(est * frac) if frac is not None and n >= self.min_context else est)
        adm = admit(ests, max(0, self.capacity - used), stop_at_first_miss=True)
        oversize = adm.oversize and not running  # with requests running, an oversize newcomer waits for them
        allow = len(adm.admitted) if (not adm.oversize or oversize) else 0
        used += adm.used if allow else 0
        st = self.stats
        st.decisions += 1
        st.running_units = running_used
        st.tracked_requests = sum(s is not None for s in sizes)
        st.working_set_fraction = frac
        st.measured_decisions += int(frac is not None)
        st.working_set_fraction_sum += frac if frac is not None else 0.0
        st.oversize_admissions += int(oversize)
        if allow and not oversize:
            st.peak_planned_units = max(st.peak_planned_units, used)
        held = len(waiting) - allow
        if held > 0:
            st.limited += 1
            st.held_requests += held
        if self.metrics is not None:
            self.metrics.running_units.set(st.running_units)
            if held > 0:
                self.metrics.limited.inc()
                self.metrics.held.inc(held)
        self.allowance = allow
        if allow == 0:
            self._full_by_us, self._passes_since = True, 0

    def end_pass(self) -> None:
        self.allowance = None


def make_admission(scheduler):
    """The scheduler's :class:`WorkingSetAdmission` when the mode serves it, else None."""
    tier = getattr(getattr(scheduler, "tree_cache", None), "tier", None)
    backend = scheduler.tp_worker.model_runner.attn_backend
    src = getattr(backend, "sparse_working_set", None)
    if tier is None or src is None:
        return None
    tracker = src.tracker
    metrics = AdmissionMetrics() if scheduler.server_args.enable_metrics else None
    # the unit cache counts (layer, KV page, KV head) units; the tracker (layer, KV head, block) ones
    capacity = int(tier.pool.cache.capacity) * int(tier.page_size) // int(src.block_size)
    adm = WorkingSetAdmission(tracker, capacity_units=capacity,
                              units_per_block=tracker.num_layers * tracker.num_kv_heads,
                              block_size=int(src.block_size), min_context=int(src.min_context), metrics=metrics)
    logger.info("sglang-sparse: working-set admission on: GPU unit cache %d units, window %d, %d tracked slots, "
                "block %d tokens", adm.capacity, adm.window, tracker.num_slots, src.block_size)
    return adm


# ---------------------------------------------------------------------- hooks
def new_batch_prefill_hook(original, scheduler, running_batch, *args, **kwargs):
    """AROUND ``Scheduler.get_new_batch_prefill``: this pass's allowance around the stock code."""
    adm = getattr(scheduler, "sparse_ws_admission", None)
    if adm is None:
        return original(scheduler, running_batch, *args, **kwargs)
    adm.begin_pass(scheduler, running_batch)
    try:
        return original(scheduler, running_batch, *args, **kwargs)
    finally:
        adm.end_pass()


def allocatable_hook(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_num_allocatable_reqs``: cap the stock count with the allowance."""
    adm = getattr(scheduler, "sparse_ws_admission", None)
    if adm is None or adm.allowance is None:
        return result
    return min(result, adm.allowance)
