"""LoopServe decode's working set: what each decode step read goes into the host tier admission's tracker.

Under ``--sparse loopserve`` with the host tier (``host_tier_gb > 0``) and ``working_set_admission`` (default
on), every sparse decode step records, per layer, the tokens its split-list decode attended
(``LoopServeRunner.decode``'s lists ``[rows, num_kv_heads, width]`` int32, first ``lens`` valid) into a
:class:`radix_sparse.working_set_tracker.WorkingSetTracker` as units ``(layer, KV head, block)`` with
``block = token // page_size``: the host tier's unit cache holds ``(layer, KV page, KV head)`` units, so a
tracked unit is one cache unit and the admission (:mod:`sglang_sparse.host_tier.admission`) compares working
sets with the cache capacity without conversion. Same tracker, same admission as ``--sparse psa``.

Where the work goes:
  * host, once per decode batch (:meth:`LoopServeWorkingSet.plan`, from ``LoopServeRunner._plan_decode`` for an
    eager step, from :mod:`sglang_sparse.loopserve.graph` for a captured / replayed one): the sparse rows'
    request ids -> tracker slots (requests absent from the batch released), the slots copied into the tracker's
    fixed buffers, the step counters advanced on the device;
  * per layer (:meth:`LoopServeWorkingSet.record`): one launch of
    :func:`flashinfer_ext.host_tier.ws_record.ws_record_tokens` on the kernel path (CUDA, or a CPU server with
    config ``runner: "kernel"``), the tracker's torch path on the CPU reference path. No host sync, no
    allocation on the kernel path: a graph-replayed step records through the graph's static lists into the
    tracker's fixed buffers (rows without a known request, capture and padding rows, write the trash row).

Cautions: rows that decode densely (below ``min_context``, alpha 1.0, prefill not done) are not tracked and
count their whole context in the admission. Memory: ``(working_set_slots + 1) x layers x KV heads x (context
length / page size + 1) x 4`` bytes (logged); with ``--page-size 1`` a unit is one token, so the tracker takes
16 times the memory it takes at page 16 (``working_set_slots`` bounds it).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["LoopServeWorkingSet", "make_working_set"]

logger = logging.getLogger("sglang_sparse")


class LoopServeWorkingSet:
    """The tracker of one LoopServe runner and how its decode steps feed it (see the module docstring)."""

    def __init__(self, tracker, block_size: int, min_context: int) -> None:
        if block_size < 1:
            raise ValueError(f"LoopServeWorkingSet.block_size={block_size} must be >= 1")
        self.tracker = tracker
        self.block_size = int(block_size)
        self.min_context = int(min_context)
        self.active = False  # the current decode step records (planned by plan())

    def reset(self) -> None:
        """A batch that does not record (start of every batch's planning)."""
        self.active = False

    def plan(self, rids: list, pad_to: int | None = None) -> None:
        """Host plan of a recording decode step: ``rids`` the request ids of the step's sparse rows in list order
        (``None`` for rows without a request: the trash slot), ``pad_to`` the padded row count of a graph."""
        tr = self.tracker
        keyed = any(r is not None for r in rids)  # a capture (no requests) keeps every slot
        tr.plan_rows(tr.assign(rids, release_absent=keyed), pad_to=pad_to)
        tr.begin_step()
        self.active = True

    def record(self, layer: int, lists: torch.Tensor, lens: torch.Tensor) -> None:
        """Per layer: mark the blocks of ``lists [rows, num_kv_heads, width]`` int32 (first ``lens [rows,
        num_kv_heads]`` int32 entries) as read at this step (device only)."""
        if self.active:
            self.tracker.record_tokens(layer, lists, lens, self.block_size)


def make_working_set(config, page_size: int, shape, model_runner, device, use_kernels: bool):
    """The runner's :class:`LoopServeWorkingSet` (``host_tier_gb > 0`` and ``working_set_admission``), or None."""
    from sglang_sparse.host_tier.cache import host_tier_enabled

    if not (host_tier_enabled(config) and getattr(config, "working_set_admission", False)):
        return None
    from radix_sparse.working_set_tracker import WorkingSetTracker

    rtt = model_runner.req_to_token_pool
    max_bs = int(rtt.size)
    block = max(1, int(page_size))
    from flashinfer_ext.host_tier.ws_record import ws_record_tokens, ws_record_tokens_reference

    # the Triton kernel (one launch per layer, graph-safe) on the kernel path, its torch reference otherwise
    kernel = ws_record_tokens if use_kernels else ws_record_tokens_reference
    tracker = WorkingSetTracker(num_slots=min(int(config.working_set_slots), max_bs), num_layers=shape.num_layers,
                                num_kv_heads=shape.num_kv_heads, max_blocks=-(-rtt.req_to_token.shape[1] // block),
                                window=int(config.working_set_window), max_batch_size=max_bs, device=device,
                                token_record_kernel=kernel, order_buffers=False)
    logger.info("sglang-sparse loopserve: working-set tracker %.1f MiB (%d slots, window %d, block %d, record %s)",
                tracker.nbytes / 2**20, tracker.num_slots, tracker.window, block, "triton" if use_kernels else "torch")
    return LoopServeWorkingSet(tracker, block, int(config.min_context))
