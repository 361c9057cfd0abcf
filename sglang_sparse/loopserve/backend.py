"""``--sparse loopserve``: LoopServe online vertical/slash prefill + progressive decode in SGLang's own backend.

Like ``psa`` (:mod:`sglang_sparse.psa.backend`), the mode keeps the attention backend the server
would use anyway (``torch_native`` on CPU, ``flashinfer``/``triton`` on the GPU) and turns that
object into a direct subclass carrying the methods of :class:`LoopServeMixin`, once, in the
scheduler process (``runtime_hooks.attention_backend_hook``). Per batch
:meth:`LoopServeRunner.begin_batch` plans (host work); per layer, when every row of the batch is sparse,
``forward_extend``/``forward_decode`` write K/V exactly as the stock backend does
(:func:`_save_kv`) and run only the sparse kernels (no stock attention compute); in a mixed batch
the stock path computes every row and the sparse rows are then overwritten (correct, no saving
for that batch). See :mod:`sglang_sparse.loopserve.runner` for the paths and where host work
goes, :mod:`sglang_sparse.loopserve.radix` for the per-turn lines on radix nodes, and
:mod:`sglang_sparse.loopserve.stats` for the statistics.

The scheduler rows' ``Req`` objects reach the backend through ``forward_batch.sampling_info.sparse_reqs``
(set by ``api_hooks.forward_batch_hook``); statistics leave through ``api_hooks.model_forward_hook``
(SGLang's ``customized_info``) and reach the response as ``metadata["sparse"]`` through
``api_hooks``' response hooks (the ``STEP_SOURCES`` registry there).
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.config import LoopServeConfig
from sglang_sparse.config import uses_kernels
from sglang_sparse.loopserve.runner import LoopServeRunner
from sglang_sparse.loopserve.stats import LoopServeMetrics, LoopServeStats, account_rows
from sglang_sparse.psa.runner import AttnShape
from sglang_sparse.stats import DenseRowCache, StepRows

__all__ = ["install", "LoopServeMixin"]

logger = logging.getLogger("sglang_sparse")


class LoopServeMixin:
    """Methods placed in front of a stock backend class (reached through ``self._ls_base``)."""

    def init_forward_metadata(self, forward_batch):
        self._ls_in_eager_init = True  # a base that routes through _out_graph must not graph-plan
        try:
            self._ls_base.init_forward_metadata(self, forward_batch)
        finally:
            self._ls_in_eager_init = False
        self._ls_runner.begin_batch(self, forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        """Decode CUDA graph capture / replay preparation (SGLang calls it outside the graph)."""
        from sglang_sparse.graph_variants import capture_variant, plan_variant_graph

        graphs = self._ls_graphs
        eager = getattr(self, "_ls_in_eager_init", False)
        variant = None if eager or graphs is None else capture_variant() if in_capture else graphs._decided[1]
        plan_variant_graph(self, forward_batch, in_capture, variant,
                           lambda: self._ls_base.init_forward_metadata_out_graph(self, forward_batch, in_capture))
        if graphs is None or eager or not forward_batch.forward_mode.is_decode():
            return
        graphs.plan(self, forward_batch, in_capture)

    def sparse_wants_graph(self, forward_batch) -> bool:
        """``can_run_graph`` gate without a stock graph: replay only the steady decode steps."""
        return self._ls_graphs is not None and self._ls_graphs.wants_graph(forward_batch)

    def sparse_graph_variant(self, forward_batch, peek: bool = False) -> str | None:
        """``can_run_graph`` gate (``api_hooks.graph_gate_hook``, :mod:`sglang_sparse.graph_variants`):
        ``"sparse"`` for steady steps, ``"select"`` for re-selecting steps that fit the re-selecting graphs,
        ``"dense"`` for batches without a sparse row, None: eager."""
        return None if self._ls_graphs is None else self._ls_graphs.graph_variant(forward_batch, peek)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        runner = self._ls_runner
        hq, d = layer.tp_q_head_num, layer.head_dim
        if runner.ext_rows and runner.all_rows_sparse and _can_skip_stock(self, layer):
            # every row is sparse: no stock attention compute at all; K/V written as stock writes them
            _save_kv(self, layer, forward_batch, k, v, *args, **kwargs)
            o = q.new_empty(q.shape[0], hq * d)
            runner.extend(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
            return o
        o = self._ls_base.forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)
        if runner.ext_rows:  # mixed batch: the stock path computed every row; sparse rows are overwritten
            runner.extend(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):
        runner = self._ls_runner
        hq, d = layer.tp_q_head_num, layer.head_dim
        if runner.dec is not None and runner.all_rows_sparse and _can_skip_stock(self, layer):
            _save_kv(self, layer, forward_batch, k, v, *args, **kwargs)
            o = q.new_empty(q.shape[0], hq * d)
            runner.decode(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
            return o
        o = self._ls_base.forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs)
        if runner.dec is not None:
            runner.decode(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
        return o

    def loopserve_step_rows(self) -> StepRows | None:
        """This forward's per-row statistics as SGLang ``customized_info`` (None when nothing ran)."""
        runner = self._ls_runner
        if runner.bs == 0:
            return None
        if runner.dense_rows is not None:  # the stock attention alone: host tuples, shared (nothing to count)
            rows, runner.dense_rows = runner.dense_rows, None
            return self._ls_dense_rows.rows(rows)
        if runner.step_rows is None:
            return None
        runner.finish_extend(self)
        rows = runner.step_rows[: runner.bs]
        host = rows if rows.device.type == "cpu" else rows.to("cpu", non_blocking=True)
        stats, metrics = self.sparse_stats, self._ls_metrics
        runner.step_rows = None
        return StepRows(host.clone() if host is rows else host, lambda r: account_rows(r, stats, metrics))



# Stock backends whose KV write this module reproduces exactly (``set_kv_buffer`` with a
# ``KVWriteLoc(out_cache_loc, swa_out_cache_loc)`` and, for FlashInfer, the layer's write scales).
_KV_WRITERS = ("FlashInferAttnBackend", "TorchNativeAttnBackend")


def _can_skip_stock(backend, layer) -> bool:
    """True when the stock attention may be skipped for an all-sparse batch (plain self-attention,
    a backend whose KV write :func:`_save_kv` reproduces, no FlashInfer dequant workspace)."""
    return (backend._ls_base.__name__ in _KV_WRITERS and not layer.is_cross_attention
            and getattr(layer, "sliding_window_size", -1) in (-1, None)
            and getattr(layer, "qk_head_dim", layer.head_dim) == getattr(layer, "v_head_dim", layer.head_dim)
            and not getattr(backend, "prefill_uses_dequant_workspace", False)
            and not getattr(backend, "decode_uses_dequant_workspace", False))


def _save_kv(backend, layer, forward_batch, k, v, *args, **kwargs) -> None:
    """Write this forward's K/V exactly as the stock ``forward_extend``/``forward_decode`` would."""
    save = kwargs.get("save_kv_cache", args[0] if args else True)
    if not save or k is None or v is None:
        return
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if backend._ls_base.__name__ == "FlashInferAttnBackend":
        loc = KVWriteLoc(forward_batch.out_cache_loc, backend.forward_metadata.swa_out_cache_loc)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, *backend._kv_write_scales(layer))
    else:
        loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)


def install(backend, config: LoopServeConfig, page_size: int, enable_metrics: bool = False, model_runner=None):
    """Turn ``backend`` (a constructed stock backend) into its LoopServe variant, in place (idempotent).

    Also installs ``--sparse lastwindow`` (``config`` a :class:`~sglang_sparse.config.LastWindowConfig`):
    the same runner with a dense prefill, one top-B selection and no line store."""
    mode = config.mode  # "loopserve" or "lastwindow" (its baseline: same runner, no lines)
    if getattr(backend, "sparse_installed_mode", None) == mode:
        return backend
    if model_runner is None:
        raise ValueError("sglang-sparse loopserve: install() needs the model_runner")
    from sglang_sparse.loopserve import radix as loopserve_radix

    device = torch.device(model_runner.device) if isinstance(model_runner.device, str) else model_runner.device
    args = model_runner.server_args
    graphs_on = device.type == "cuda" and not getattr(args, "disable_cuda_graph", True)
    base = type(backend)
    methods = {k: v for k, v in vars(LoopServeMixin).items() if not k.startswith("__")}
    prefix = "LoopServe" if mode == "loopserve" else "LastWindow"
    backend.__class__ = type(f"{prefix}{base.__name__}", (base,), {**methods, "__module__": __name__,
                                                                 "_ls_base": base})
    stats = LoopServeStats()
    metrics = LoopServeMetrics() if enable_metrics else None
    store = loopserve_radix.RadixLines(config, stats, metrics) if mode == "loopserve" else None
    # the line store lives on the scheduler's radix cache (runtime_hooks.scheduler_init_hook), where its hooks run
    backend.sparse_tree_state = {} if store is None else {loopserve_radix.LINES_ATTR: store}
    kernels = uses_kernels(config, device.type)
    backend._ls_cfg = config
    shape = AttnShape.of(model_runner)
    max_context = getattr(getattr(model_runner, "model_config", None), "context_len", None)
    backend._ls_runner = LoopServeRunner(config, shape, device, use_kernels=kernels, store=store,
                                         max_context=int(max_context) if max_context else None,
                                         batch_invariant=bool(getattr(args, "enable_deterministic_inference", False)))
    if mode == "loopserve":  # decode steps record their working sets (host tier admission; sglang_sparse.loopserve.ws)
        from sglang_sparse.loopserve.ws import make_working_set

        ws = make_working_set(config, page_size, shape, model_runner, device, kernels)
        backend._ls_runner.ws = ws
        if ws is not None:
            from sglang_sparse.host_tier.admission import WorkingSetSource

            backend.sparse_working_set = WorkingSetSource(ws.tracker, ws.block_size, ws.min_context)
    backend._ls_metrics = metrics
    backend._ls_dense_rows = DenseRowCache()  # step rows of batches without a sparse row (loopserve_step_rows)
    backend._ls_graphs = None
    if graphs_on:  # steady decode steps replay SGLang's decode graphs (sglang_sparse.loopserve.graph)
        from sglang_sparse.loopserve.graph import LoopServeGraphs

        backend._ls_graphs = LoopServeGraphs(backend._ls_runner, stats=stats, max_bs=config.graph_max_bs,
                                             select_rows=getattr(config, "select_graph_rows", 0))
    # re-selecting decode steps replay a third graph variant (sglang_sparse.graph_variants.capture_one_shape_hook)
    backend.sparse_select_graphs = backend._ls_graphs is not None and backend._ls_graphs.select_rows > 0
    backend.sparse_select_max_bs = int(config.graph_max_bs)
    backend.sparse_stats = stats
    backend.sparse_stock_graphs = bool(config.stock_graphs)  # sglang_sparse.graph_variants
    backend.sparse_installed_mode = mode
    # prefill CUDA graphs replay only extend batches below min_context (api_hooks.prefill_graph_gate_hook)
    backend.sparse_prefill_graph_below = int(config.min_context)
    logger.info("sglang-sparse %s: %s path (%s), line store %d MiB, decode CUDA graphs %s", mode,
                "kernel" if kernels else "reference", device.type, getattr(config, "line_store_mb", 0),
                f"for steady steps (lists <= {backend._ls_runner.split_width}, batch <= {config.graph_max_bs})"
                if graphs_on else "off")
    return backend
