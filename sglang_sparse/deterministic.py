"""Batch invariance of the stock decode rows a sparse mode runs eagerly, under ``--enable-deterministic-inference``.

SGLang 0.5.17's FlashInfer backend plans its decode two ways when deterministic inference is on:

  * graph capture and replay (``init_forward_metadata_out_graph``): ``disable_split_kv=True``, every request's KV is
    reduced by one work unit;
  * eager (``init_forward_metadata``): ``fixed_split_size=SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE`` (2048), a
    request longer than that is reduced in 2048-token splits and merged.

Both are batch invariant on their own, but they round differently for requests longer than one split. A stock
``--sparse off`` server replays graphs for every decode batch it captured, so its outputs are those of the
unsplit plan. A sparse mode runs some decode batches eagerly that ``off`` would have replayed: a batch mixing
sparse and stock rows (LoopServe / lastwindow / PSA), a re-selection step wider than the captured lists. Its stock
rows (requests the mode never engaged) then took the split plan and drifted from ``off``'s text, although nothing
sparse touched them.

:func:`plan_eager_decode_like_replay` makes the backend's eager decode planning use the replay plan
(``fixed_split_size=None, disable_split_kv=True``) for the batch sizes ``off`` would have replayed, so a stock row's
decode no longer depends on whether its batch was replayed: it is the same as ``off``'s step. Those sizes are learnt
from SGLang's own unsplit plans (graph capture and replay: the largest batch size planned unsplit); batches above it,
and every batch of a server without decode graphs (``--disable-cuda-graph``), keep the split plan, as ``off`` runs
them eagerly too. Applied only when the backend is a FlashInfer backend in deterministic mode
(``disable_cuda_graph_kv_split`` is SGLang's own marker of that plan); other backends and non-deterministic servers
are left as they are. Cost: the unsplit plan gives one work unit per request, so an eager decode batch of a few very
long requests uses fewer SMs than the split plan; it is the plan every replayed step already runs.
"""

from __future__ import annotations

import logging

__all__ = ["plan_eager_decode_like_replay"]

logger = logging.getLogger("sglang_sparse")


class _ReplayLikeUpdate:
    """``indices_updater_decode.update`` in front of SGLang's: plans an eager decode batch unsplit when its size is
    at most the largest size SGLang itself planned unsplit (its captured / replayed graphs)."""

    def __init__(self, update):
        self.update = update
        self.replay_max_bs = 0  # the largest batch size SGLang planned unsplit (0: no decode graph so far)
        self.forced = 0         # eager plans made unsplit (statistics, tests)

    def __call__(self, req_pool_indices, *args, **kwargs):
        bs = len(req_pool_indices)
        if kwargs.get("disable_split_kv"):  # SGLang's graph plan (capture or replay)
            self.replay_max_bs = max(self.replay_max_bs, bs)
        elif bs <= self.replay_max_bs:      # an eager batch off would have replayed
            kwargs["fixed_split_size"] = None
            kwargs["disable_split_kv"] = True
            self.forced += 1
        return self.update(req_pool_indices, *args, **kwargs)


def plan_eager_decode_like_replay(backend) -> bool:
    """Put :class:`_ReplayLikeUpdate` in front of ``backend.indices_updater_decode.update``.

    Returns True when the backend was changed (a FlashInfer backend with ``disable_cuda_graph_kv_split`` set, i.e.
    deterministic inference), False otherwise. Idempotent."""
    if not getattr(backend, "disable_cuda_graph_kv_split", False):
        return False
    updater = getattr(backend, "indices_updater_decode", None)
    update = getattr(updater, "update", None)
    if update is None:
        return False
    if isinstance(update, _ReplayLikeUpdate):
        return True
    updater.update = _ReplayLikeUpdate(update)
    logger.info("sglang-sparse: deterministic inference: eager decode batches of the sizes SGLang replays as CUDA "
                "graphs are planned as the graphs are (no KV split), so stock rows in them match --sparse off")
    return True
