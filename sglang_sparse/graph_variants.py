"""Two decode CUDA graphs per batch size under psa / loopserve / lastwindow: one over the sparse path, one stock.

A mode's decode graphs are captured over its sparse path, so a batch with no sparse row (every prompt shorter
than ``min_context``) used to decode eagerly, several times slower than stock. SGLang 0.5.17's
``DecodeCudaGraphRunner`` can record two variants per batch size (its LoRA / no-LoRA pair: the runner's
``record_nolora_graph`` flag, ``ShapeKey.variant_label``, chosen per batch by ``_resolve_lora_variant``). The
modes reuse that pair when no LoRA adapter is served:

* label ``"lora"`` (:data:`SPARSE`) - the mode's sparse path, as before;
* label ``"nolora"`` (:data:`DENSE`) - the stock decode, replayed for batches with no sparse row.

Hooks (registered in :mod:`sglang_sparse.plugin`): :func:`capture_hook` (AROUND ``DecodeCudaGraphRunner.capture``)
turns the pair on when the backend offers ``sparse_graph_variant``; :func:`resolve_variant_hook` (AROUND
``_resolve_lora_variant``) maps the backend's per-batch answer to the label. The backend learns which variant
a capture records from :func:`capture_variant`. Memory: the stock graphs add one set of graph outputs per batch
size (SGLang's shared graph pool).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_sparse")

SPARSE = "lora"
DENSE = "nolora"


def _backend(graph_runner):
    return getattr(getattr(graph_runner, "model_runner", None), "attn_backend", None)


def _lora_served(graph_runner) -> bool:
    args = getattr(getattr(graph_runner, "model_runner", None), "server_args", None)
    return bool(getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None))


def dual_capture(graph_runner) -> bool:
    """True when this runner records a stock graph beside each sparse one."""
    return bool(getattr(graph_runner, "sparse_dual_graphs", False))


def capture_hook(original, graph_runner, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner.capture``: record the stock variant too (see the module docstring)."""
    backend = _backend(graph_runner)
    if getattr(backend, "sparse_graph_variant", None) is not None and getattr(backend, "sparse_stock_graphs", False) \
            and not _lora_served(graph_runner):
        graph_runner.record_nolora_graph = True
        graph_runner.sparse_dual_graphs = True
        logger.info("sglang-sparse: decode CUDA graphs recorded twice per batch size (sparse path and stock)")
    return original(graph_runner, *args, **kwargs)


def resolve_variant_hook(original, graph_runner, forward_batch, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner._resolve_lora_variant``: the stock graph for batches without a sparse row."""
    fn = getattr(_backend(graph_runner), "sparse_graph_variant", None)
    if fn is None or not dual_capture(graph_runner):
        return original(graph_runner, forward_batch, *args, **kwargs)
    return DENSE if fn(forward_batch, peek=True) == "dense" else SPARSE


def capture_variant() -> str | None:
    """During a capture: ``"dense"`` while SGLang records the stock variant, ``"sparse"`` for the sparse one,
    None when the runner records one variant only."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_lora_variant

    label = get_capture_lora_variant()
    return None if label is None else ("dense" if label == DENSE else "sparse")
