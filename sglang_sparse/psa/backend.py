"""``--sparse psa``: PSA progressive threshold decode inside SGLang's own attention backend.

The mode keeps the attention backend the server would use anyway (``torch_native`` on
CPU, ``flashinfer`` on the GPU) and turns that object into a direct subclass carrying the
methods of :class:`PsaDecodeMixin`, once, in the scheduler process
(``runtime_hooks.attention_backend_hook``). Stock names stay intact, so SGLang's name-based
checks keep working. Per batch the device-specific runner of :mod:`sglang_sparse.psa.runner`
plans; per layer ``forward_extend`` keeps the block metadata current after the stock write and
``forward_decode`` attends sparsely for the rows whose context reached ``min_context``.

Statistics leave the forward as one device tensor of step rows (:mod:`sglang_sparse.psa.stats`),
handed to SGLang's ``customized_info`` by ``api_hooks.model_forward_hook``.
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.cuda_runner import PsaCudaRunner
from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner, kernel_config
from sglang_sparse.psa.stats import PsaMetrics, PsaStats, account_rows
from sglang_sparse.stats import DenseRowCache, StepRows

__all__ = ["install", "kernel_config", "PsaDecodeMixin"]

logger = logging.getLogger("sglang_sparse")


class PsaDecodeMixin:
    """Methods placed in front of a stock backend class; see :func:`install`.

    ``install`` copies these methods into a direct subclass of the stock class (CPython
    refuses ``__class__`` assignment to a class with an extra base), so they reach the
    stock implementation through ``self._psa_base`` rather than ``super()``.
    """

    def init_forward_metadata(self, forward_batch):
        self._psa_in_eager_init = True  # a base that routes through _out_graph must not graph-plan
        try:
            self._psa_base.init_forward_metadata(self, forward_batch)
        finally:
            self._psa_in_eager_init = False
        runner = self._psa_runner
        runner.begin_batch(self, forward_batch)
        if runner.is_decode and runner.bs:
            self.sparse_stats.sparse_decode_steps += int(runner.sparse_batch)
            self.sparse_stats.dense_decode_steps += int(not runner.sparse_batch)
            if self._psa_metrics is not None:
                (self._psa_metrics.sparse_steps if runner.sparse_batch else self._psa_metrics.dense_steps).inc()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        """Decode CUDA graph capture / replay preparation (SGLang calls it outside the graph)."""
        from sglang_sparse.graph_variants import capture_variant, plan_variant_graph

        runner = self._psa_runner
        eager = getattr(self, "_psa_in_eager_init", False)
        # a replay follows the can_run_graph answer for its real batch (the view here is SGLang's padded copy)
        variant = None if eager else capture_variant() if in_capture else getattr(runner, "_graph_decided",
                                                                                   (None, None))[1]
        plan_variant_graph(self, forward_batch, in_capture, variant,
                           lambda: self._psa_base.init_forward_metadata_out_graph(self, forward_batch, in_capture))
        if eager or not hasattr(runner, "begin_graph_batch"):
            return
        if not forward_batch.forward_mode.is_decode():
            return
        dense = variant == "dense"
        if dense:  # SGLang's stock graph (sglang_sparse.graph_variants): a batch without sparse rows
            runner.begin_dense_graph_batch(forward_batch, in_capture)
        else:
            runner.begin_graph_batch(self, forward_batch, in_capture)
        if not in_capture:
            self.sparse_stats.sparse_decode_steps += int(not dense)
            self.sparse_stats.dense_decode_steps += int(dense)
            self.sparse_stats.dense_graph_steps += int(dense)
            if self._psa_metrics is not None:
                (self._psa_metrics.dense_steps if dense else self._psa_metrics.sparse_steps).inc()

    def sparse_wants_graph(self, forward_batch) -> bool:
        return self._psa_runner.wants_graph(forward_batch)

    def sparse_graph_variant(self, forward_batch, peek: bool = False) -> str | None:
        """``can_run_graph`` gate (:mod:`sglang_sparse.graph_variants`): ``"sparse"``, ``"dense"`` or None."""
        runner = self._psa_runner
        fn = getattr(runner, "graph_variant", None)
        if fn is None:  # a runner without a stock-graph answer: sparse batches only
            return None if peek or not runner.wants_graph(forward_batch) else "sparse"
        return fn(forward_batch, peek)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        o = self._psa_base.forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)
        self._psa_runner.after_extend(self, q, layer, forward_batch)
        return o

    def sparse_note_prefill_graph(self, forward_batch) -> None:
        """Prefill-graph gate (``api_hooks.prefill_graph_gate_hook``): an extend that replays SGLang's prefill graph;
        one with a prefill probe is counted (``prefill_probe_graph_extends``)."""
        if self._psa_runner.extend_probe_rows(forward_batch):
            self.sparse_stats.prefill_probe_graph_extends += 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
        if args or kwargs:  # a stock call signature this mode does not know: stay exact, stay stock
            raise TypeError(f"sglang-sparse psa: unexpected forward_decode arguments {args} {list(kwargs)}")
        return self._psa_runner.decode(self, q, k, v, layer, forward_batch, save_kv_cache)

    def psa_step_rows(self) -> StepRows | None:
        """This forward's per-row statistics as SGLang ``customized_info`` (None when nothing ran)."""
        runner = self._psa_runner
        if runner.bs == 0:
            return None
        stats, metrics = self.sparse_stats, self._psa_metrics
        if runner.dense_rows is not None:  # the stock decode: host tuples, shared while nothing is counted
            rows, plain = runner.dense_rows
            return self._psa_dense_rows.rows(rows) if plain else \
                StepRows(None, lambda r: account_rows(r, stats, metrics), rows=rows)
        if runner.step_rows is None:
            return None
        rows = runner.step_rows[: runner.bs]
        host = rows if rows.device.type == "cpu" else rows.to("cpu", non_blocking=True)
        return StepRows(host, lambda r: account_rows(r, stats, metrics))




def make_runner(config: PsaConfig, page_size: int, model_runner):
    """The device's runner: CUDA (metadata pool + Triton/FlashInfer kernels) or CPU (fp32 reference); config
    ``runner: "kernel"`` takes the kernel runner on a CPU server too (Triton's interpreter)."""
    from sglang_sparse.config import uses_kernels

    device = torch.device(model_runner.device) if isinstance(model_runner.device, str) else model_runner.device
    shape = AttnShape.of(model_runner)
    if uses_kernels(config, device.type):
        if page_size not in (1, config.block_size):
            raise RuntimeError(f"sglang-sparse psa on CUDA needs --page-size 1 or block_size ({config.block_size}); "
                               f"got page size {page_size}")
        runner = PsaCudaRunner(
            config, config.block_size, shape, device, token_to_kv_pool=model_runner.token_to_kv_pool,
            req_to_token=model_runner.req_to_token_pool.req_to_token,
            max_batch_size=int(model_runner.req_to_token_pool.size), sm_scale=shape.head_dim ** -0.5,
            out_dtype=model_runner.dtype, page_size=page_size, exact_stock_rows=exact_stock_rows(config, model_runner))
        logger.info("sglang-sparse psa: %s %.1f MiB (%d layers, %d rows, block %d, page %d: %s), "
                    "max batch %d", "int4 key sketch" if runner.kernel_cfg.criticality == "sketch" else "block metadata",
                    runner.meta_bytes() / 2**20, shape.num_layers, runner.meta.num_rows,
                    config.block_size, page_size, "rows per page" if page_size > 1 else "rows per request block",
                    model_runner.req_to_token_pool.size)
    else:
        block = page_size if page_size > 1 else config.block_size
        runner = PsaCpuRunner(config, block, shape, device)
    runner.ws = make_tracker(config, runner.block_size, shape, model_runner, device)
    return runner


def exact_stock_rows(config: PsaConfig, model_runner) -> bool:
    """``stock_rows``: whether the stock rows of a sparse step take the stock decode's output ('auto': under
    ``--enable-deterministic-inference``, whose batch invariance the PSA kernel's rounding would break)."""
    if config.stock_rows != "auto":
        return config.stock_rows == "exact"
    return bool(getattr(getattr(model_runner, "server_args", None), "enable_deterministic_inference", False))


def make_tracker(config: PsaConfig, block_size: int, shape: AttnShape, model_runner, device):
    """The working-set tracker of the host tier's admission (``host_tier_gb > 0`` and
    ``working_set_admission``), or None."""
    from sglang_sparse.config import uses_kernels
    from sglang_sparse.host_tier.cache import host_tier_enabled

    if not (host_tier_enabled(config) and config.working_set_admission):
        return None
    from radix_sparse.working_set_tracker import WorkingSetTracker

    rtt = model_runner.req_to_token_pool
    max_bs = int(rtt.size)
    kernel = None
    if uses_kernels(config, torch.device(device).type):
        from flashinfer_ext.host_tier.ws_record import ws_record as kernel  # one fused launch per layer
    tracker = WorkingSetTracker(num_slots=min(int(config.working_set_slots), max_bs), num_layers=shape.num_layers,
                                num_kv_heads=shape.num_kv_heads, max_blocks=-(-rtt.req_to_token.shape[1] // block_size),
                                window=int(config.working_set_window), max_batch_size=max_bs, device=device,
                                record_kernel=kernel)
    logger.info("sglang-sparse psa: working-set tracker %.1f MiB (%d slots, window %d, record %s)",
                tracker.nbytes / 2**20, tracker.num_slots, tracker.window, "triton" if kernel else "torch")
    return tracker


def install(backend, config: PsaConfig, page_size: int, enable_metrics: bool = False, model_runner=None):
    """Turn ``backend`` (a constructed stock backend) into its PSA variant, in place (idempotent)."""
    if getattr(backend, "sparse_installed_mode", None) == "psa":
        return backend
    if model_runner is None:
        raise ValueError("sglang-sparse psa: install() needs the model_runner")
    base = type(backend)
    methods = {k: v for k, v in vars(PsaDecodeMixin).items() if not k.startswith("__")}
    backend.__class__ = type(f"Psa{base.__name__}", (base,), {**methods, "__module__": __name__, "_psa_base": base})
    backend._psa_runner = runner = make_runner(config, page_size, model_runner)
    if runner.ws is not None:  # the host tier admission's tracker (sglang_sparse.host_tier.admission)
        from sglang_sparse.host_tier.admission import WorkingSetSource

        backend.sparse_working_set = WorkingSetSource(runner.ws, int(runner.block_size), int(config.min_context))
    backend._psa_metrics = PsaMetrics() if enable_metrics else None
    backend._psa_dense_rows = DenseRowCache()  # step rows of stock-decode batches (psa_step_rows)
    backend.sparse_stats = PsaStats(reporter=getattr(runner, "meta_report", None))
    backend.sparse_stock_graphs = bool(config.stock_graphs)  # sglang_sparse.graph_variants
    backend.sparse_installed_mode = "psa"
    # no sparse_prefill_graph_below (api_hooks.prefill_graph_gate_hook): PSA leaves extends stock, so every extend
    # batch may replay SGLang's prefill graphs, those with a prefill probe too: under the breakable prefill graphs (the
    # only prefill graphs a sparse mode keeps, server_args._prefill_graph_requirements) attention runs eagerly between
    # the captured segments, so the probe in forward_extend runs there, planned by init_forward_metadata beforehand
    return backend
