"""Two decode CUDA graphs per batch size under psa / loopserve / lastwindow: one over the sparse path, one stock.

A mode's decode graphs are captured over its sparse path, so a batch with no sparse row (every prompt shorter
than ``min_context``) used to decode eagerly, several times slower than stock. SGLang 0.5.17's
``DecodeCudaGraphRunner`` can record two variants per batch size (its LoRA / no-LoRA pair: the runner's
``record_nolora_graph`` flag, ``ShapeKey.variant_label``, chosen per batch by ``_resolve_lora_variant``). The
modes reuse that pair when no LoRA adapter is served:

* label ``"lora"`` (:data:`SPARSE`) - the mode's sparse path, as before;
* label ``"nolora"`` (:data:`DENSE`) - the stock decode, replayed for batches with no sparse row;
* label ``"sparse_select"`` (:data:`SELECT`, loopserve) - the sparse path of a step where some rows re-select
  their top-B (:func:`capture_one_shape_hook` records it right after the sparse one, with the same forward).

Hooks (registered in :mod:`sglang_sparse.plugin`): :func:`capture_hook` (AROUND ``DecodeCudaGraphRunner.capture``)
turns the pair on when the backend offers ``sparse_graph_variant`` (and the third variant when it sets
``sparse_select_graphs``); :func:`resolve_variant_hook` (AROUND
``_resolve_lora_variant``) maps the backend's per-batch answer to the label. The backend learns which variant
a capture records from :func:`capture_variant`. Memory: the stock graphs add one set of graph outputs per batch
size (SGLang's shared graph pool), and each variant keeps the stock decode wrappers its capture created
(:func:`plan_variant_graph`: SGLang keeps one set per size and plans only that one at replay).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_sparse")

SPARSE = "lora"
DENSE = "nolora"
SELECT = "sparse_select"


def _backend(graph_runner):
    return getattr(getattr(graph_runner, "model_runner", None), "attn_backend", None)


def _lora_served(graph_runner) -> bool:
    args = getattr(getattr(graph_runner, "model_runner", None), "server_args", None)
    return bool(getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None))


def dual_capture(graph_runner) -> bool:
    """True when this runner records a stock graph beside each sparse one."""
    return bool(getattr(graph_runner, "sparse_dual_graphs", False))


def select_capture(graph_runner) -> bool:
    """True when this runner also records a re-selecting sparse graph per batch size (loopserve)."""
    return bool(getattr(graph_runner, "sparse_select_graphs", False))


def capture_hook(original, graph_runner, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner.capture``: record the stock variant too (see the module docstring), and the
    re-selecting variant where the backend offers it."""
    backend = _backend(graph_runner)
    if getattr(backend, "sparse_graph_variant", None) is not None and getattr(backend, "sparse_stock_graphs", False) \
            and not _lora_served(graph_runner):
        graph_runner.record_nolora_graph = True
        graph_runner.sparse_dual_graphs = True
        graph_runner.sparse_select_graphs = bool(getattr(backend, "sparse_select_graphs", False))
        logger.info("sglang-sparse: decode CUDA graphs recorded %s per batch size (%s)",
                    "three times" if select_capture(graph_runner) else "twice",
                    "sparse steady, sparse re-selecting and stock" if select_capture(graph_runner)
                    else "sparse path and stock")
    return original(graph_runner, *args, **kwargs)


def capture_one_shape_hook(original, graph_runner, size, forward, stream_idx=None, variant_label=None, *args,
                           **kwargs):
    """AROUND ``DecodeCudaGraphRunner.capture_one_shape``: after the sparse variant of a batch size, record the
    re-selecting one (label :data:`SELECT`) with the same forward, when the runner records it and the size is at
    most the backend's ``sparse_select_max_bs`` (larger batches never replay it)."""
    out = original(graph_runner, size, forward, stream_idx, variant_label, *args, **kwargs)
    max_bs = getattr(_backend(graph_runner), "sparse_select_max_bs", None)
    if variant_label == SPARSE and select_capture(graph_runner) and (max_bs is None or size <= max_bs):
        from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

        _set_capture_lora_variant(SELECT)
        try:
            original(graph_runner, size, forward, stream_idx, SELECT, *args, **kwargs)
        finally:
            _set_capture_lora_variant(variant_label)
    return out


def resolve_variant_hook(original, graph_runner, forward_batch, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner._resolve_lora_variant``: the stock graph for batches without a sparse row."""
    fn = getattr(_backend(graph_runner), "sparse_graph_variant", None)
    if fn is None or not dual_capture(graph_runner):
        return original(graph_runner, forward_batch, *args, **kwargs)
    v = fn(forward_batch, peek=True)
    if v == "select" and select_capture(graph_runner):
        return SELECT
    return DENSE if v == "dense" else SPARSE


def capture_variant() -> str | None:
    """During a capture: ``"dense"`` while SGLang records the stock variant, ``"sparse"`` for the sparse one,
    ``"select"`` for the re-selecting sparse one, None when the runner records one variant only."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_lora_variant

    label = get_capture_lora_variant()
    return None if label is None else {DENSE: "dense", SELECT: "select"}.get(label, "sparse")


def plan_variant_graph(backend, forward_batch, in_capture: bool, variant: str | None, base_call) -> None:
    """Run the stock backend's ``init_forward_metadata_out_graph`` (``base_call()``) so that each decode graph
    variant of a batch size keeps and replays its own stock decode wrappers.

    SGLang 0.5.17's FlashInfer backend creates a new set of decode wrappers at each capture of a batch size and
    keeps only the last in ``decode_cuda_graph_metadata[bs]``, which every replay of that size then plans. With two
    or three graphs per size (this module) the variants captured first hold wrappers that replays no longer plan:
    a graph that runs the stock decode inside the sparse path (psa ``stock_rows`` exact, loopserve's mixed rows)
    replayed the capture-time plan left in its wrappers' own workspace (psa ``stock_rows`` exact stopped with an
    illegal memory access on the testbed's long preset). Here the wrappers each capture created are kept per
    (batch size, ``variant``) on the backend and put back in SGLang's slot before a replay of that variant plans
    them. ``variant``: the capture's (:func:`capture_variant`) or the replayed batch's answer; None (one variant per
    size) or a backend without that table: ``base_call()`` alone. Host work only (a dict lookup), outside the graph.
    """
    table = getattr(backend, "decode_cuda_graph_metadata", None)
    if variant is None or not isinstance(table, dict) or not forward_batch.forward_mode.is_decode_or_idle():
        base_call()
        return
    kept = backend.__dict__.setdefault("_sparse_variant_wrappers", {})
    bs = int(forward_batch.batch_size)
    if not in_capture and (bs, variant) in kept:
        table[bs] = kept[(bs, variant)]
    base_call()
    if in_capture and bs in table:
        kept[(bs, variant)] = table[bs]
