"""``--sparse`` and ``--sparse-config`` on stock ``python -m sglang.launch_server``.

:class:`SparseServerArgs` subclasses SGLang's ``ServerArgs`` with two annotated fields;
the plugin installs it (HookRegistry REPLACE) as ``sglang.srt.server_args.ServerArgs``
and as ``Engine.server_args_class``, so ``add_cli_args`` derives both flags (they show
in ``--help``), ``sgl.Engine(sparse=..., sparse_config=...)`` takes them, and the
object pickled to the scheduler process carries them.

Validation happens in ``__post_init__`` before SGLang resolves anything (and long
before the model loads); afterwards ``sparse_config`` holds the resolved config as
canonical JSON with every default filled in.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import sglang.srt.server_args as _sglang_server_args
from sglang.srt.arg_groups.arg_utils import NS, A, Arg

from sglang_sparse.modes import (
    MODES,
    SparseConfigError,
    SparseContext,
    check_device,
    check_mode,
    load_config_arg,
    modes_help,
    resolve_sparse,
)

_BaseServerArgs = _sglang_server_args.ServerArgs


def _mode_arg(value: str) -> str:
    try:
        return check_mode(value)
    except SparseConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _config_arg(value: str) -> str:
    """Syntax check at parse time (JSON object or readable @file); keys are checked per mode later."""
    try:
        load_config_arg(value)
    except SparseConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _config_help() -> str:
    per_mode = "; ".join(f"{n}: {s.config_cls.describe()}" for n, s in MODES.items())
    return ("Options of the --sparse mode as a JSON object, or @path/to/file.json. Unknown keys, "
            "wrong types and out-of-range values are refused at start-up. A mode with min_context engages only from "
            "that many tokens of context; when it is above the longest sequence the server allows (the context "
            "length, or the KV pool if smaller, minus one) the mode is dormant: nothing of it is installed and the "
            "server runs as --sparse off (a start-up warning; /server_info sparse.engagement). "
            f"Keys per mode: {per_mode}.")


@dataclasses.dataclass
class SparseServerArgs(_BaseServerArgs):
    """SGLang's ServerArgs plus the sglang-sparse fields."""

    sparse: A[
        str,
        Arg(help="Sparse attention mode (sglang-sparse). " + modes_help() + ". Default: off.",
            type_parser=_mode_arg),
        NS("sparse"),
    ] = "off"
    sparse_config: A[
        Optional[str],
        Arg(help=_config_help(), type_parser=_config_arg),
        NS("sparse"),
    ] = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser):
        # super(), not _BaseServerArgs: the plugin's REPLACE rebinds every module's name for SGLang's class
        super(SparseServerArgs, SparseServerArgs).add_cli_args(parser)
        install_short_errors(parser)

    def __post_init__(self):
        # Resolve first: a bad mode or config must fail before SGLang touches the model.
        ctx = resolve_sparse(self.sparse, self.sparse_config)
        check_device(ctx.mode, _device_type(self.device))
        self.sparse_config = ctx.config.to_json()
        _apply_mode_requirements(self, ctx)
        from sglang_sparse.host_tier.cache import apply_server_args as _apply_host_tier

        _apply_host_tier(self, ctx)
        _check_hooks_applied()
        super().__post_init__()
        from sglang_sparse.host_tier.cache import check_tier_sizes

        check_tier_sizes(self, ctx)  # needs the page size SGLang just resolved
        _check_resolved(self, ctx)


def install_short_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` answer a bad command line with one short usage line and the error (exit 2), not
    argparse's full usage (hundreds of lines for SGLang's flags); ``--help`` still prints everything."""

    def error(message: str):
        prog = parser.prog
        parser.exit(2, f"usage: {prog} [options] (see --help)\n{prog}: error: {message}\n")

    parser.error = error


def _apply_mode_requirements(args, ctx: SparseContext) -> None:
    """Server settings a mode needs, set before SGLang resolves them (logged, never silent).

    loopserve / lastwindow / psa on CUDA: SGLang's prefill CUDA graphs stay on (the default breakable backend,
    config ``prefill_graphs`` true). loopserve / lastwindow replay them for extend batches whose rows all end below
    ``min_context`` (the stock prefill, as under ``off``); a batch with a longer row (sparse prefill, line reuse)
    runs eagerly (``api_hooks.prefill_graph_gate_hook``). psa's prefill is stock: every extend batch may replay
    them. Another prefill graph backend
    (``--cuda-graph-backend-prefill full|tc_piecewise``) or ``prefill_graphs`` false: prefill graphs off (logged).
    loopserve / lastwindow: decode graphs stay on (``--disable-cuda-graph`` turns them off): the steady decode
    steps replay them (:mod:`sglang_sparse.loopserve.graph`), the others run eagerly.
    psa: ``--page-size`` 1 (SGLang's default: block metadata rows per request block) or ``block_size`` (rows per
    page); another page size is refused. With the host tier (``host_tier_gb`` > 0) the page is the block, so the
    page size defaults to ``block_size``. Decode graphs stay on unless the config's ``cuda_graph`` is false.
    samkv on CUDA: prefill CUDA graphs as for psa (every extend batch; the documents' assembly runs in the
    scheduler before the batch, the question's prefill over the composite is an ordinary prefix hit), the overlap
    scheduler as its config says (default: kept; :func:`_samkv_requirements`); its radix cache is checked once
    SGLang has resolved the arguments (:func:`_check_resolved`).
    """
    if _device_type(args.device) != "cuda":
        return
    if ctx.mode == "samkv":
        _samkv_requirements(args, ctx)
        return
    if ctx.mode in ("loopserve", "lastwindow"):
        _prefill_graph_requirements(args, ctx)
        return
    if ctx.mode != "psa":
        return
    import logging

    log = logging.getLogger("sglang_sparse")
    block = ctx.config.block_size
    from sglang_sparse.host_tier.cache import host_tier_enabled

    if host_tier_enabled(ctx.config) and args.page_size in (None, 1):
        log.info("sglang-sparse psa: --page-size %s -> %d (block_size; with the host tier the page is the PSA "
                 "block)", args.page_size, block)
        args.page_size = block
    elif args.page_size not in (None, 1, block):
        raise SparseConfigError(f"--sparse psa on CUDA: --page-size {args.page_size} must be 1 or equal block_size "
                                f"{block} (set it in --sparse-config)")
    if block not in (16, 32, 64):
        raise SparseConfigError(f"--sparse-config: field 'block_size' of mode 'psa' = {block} on CUDA must be "
                                "one of [16, 32, 64] (the block sizes the CUDA kernels are tuned and tested for; "
                                "with --page-size > 1 it is also the KV page size)")
    _prefill_graph_requirements(args, ctx)
    if not ctx.config.cuda_graph and not args.disable_cuda_graph:
        log.info("sglang-sparse psa: CUDA graphs disabled (--sparse-config cuda_graph=false)")
        args.disable_cuda_graph = True


# prefill CUDA-graph backends under which attention runs eagerly between captured segments (None: SGLang's default)
_EAGER_ATTENTION_PREFILL_GRAPHS = (None, "breakable")


def _prefill_graph_requirements(args, ctx: SparseContext) -> None:
    """Keep SGLang's prefill CUDA graphs under its default breakable backend (attention eager between captured
    segments; the backend's per-batch plan runs before each replay). loopserve / lastwindow replay them only for
    extend batches below ``min_context`` (``api_hooks.prefill_graph_gate_hook``); psa and samkv for every extend
    batch. Turn them off otherwise, logged."""
    import logging

    if args.disable_prefill_cuda_graph:
        return
    backend = getattr(args, "cuda_graph_backend_prefill", None)
    if ctx.config.prefill_graphs and backend in _EAGER_ATTENTION_PREFILL_GRAPHS:
        return
    why = ("--sparse-config prefill_graphs=false" if not ctx.config.prefill_graphs else
           f"--cuda-graph-backend-prefill {backend} captures attention; the sparse modes run it eagerly between the "
           "captured segments of SGLang's breakable backend only")
    logging.getLogger("sglang_sparse").info("sglang-sparse %s: prefill CUDA graphs disabled (%s)", ctx.mode, why)
    args.disable_prefill_cuda_graph = True


def _check_resolved(args, ctx: SparseContext) -> None:
    """Checks on SGLang's resolved arguments. samkv keeps the documents' KV in the radix cache, which is off with
    ``--disable-radix-cache`` and also when SGLang turns it off by itself (``--enable-deterministic-inference``
    with an attention backend whose deterministic mode has no radix cache support)."""
    if ctx.mode != "samkv" or not getattr(args, "disable_radix_cache", False):
        return
    if getattr(args, "enable_deterministic_inference", False):
        why = (f"SGLang turns it off under --enable-deterministic-inference with --attention-backend "
               f"{getattr(args, 'attention_backend', None)}; use a backend whose deterministic mode keeps it "
               "(SGLang: triton, fa3, fa4)")
    else:
        why = "it is off (--disable-radix-cache)"
    raise SparseConfigError(f"--sparse samkv keeps each document's KV in the radix cache, and {why}: every "
                            "documents request would fall back to dense")


def _samkv_requirements(args, ctx: SparseContext) -> None:
    """samkv on CUDA: prefill CUDA graphs kept under SGLang's breakable backend (:func:`_prefill_graph_requirements`:
    attention runs eagerly between the captured segments, and the assembly writes the KV pool from the scheduler
    before the batch's forward, never inside it); the overlap scheduler kept unless the config's
    ``overlap_schedule`` is false (``bench/results/samkv_overlap.md``: beside other servers on
    one GPU, servers running it, stock ``off`` included, stalled under the long preset). The documents' assembly
    (copy, RoPE shift, recompute) runs in the scheduler, where under the overlap scheduler the previous forward may
    still be in flight: it synchronises the device (:meth:`sglang_sparse.samkv.assembly.SamKVRuntime.fence`) before
    any KV read or write, so it never runs beside a forward."""
    import logging

    log = logging.getLogger("sglang_sparse")
    if not ctx.config.overlap_schedule and not getattr(args, "disable_overlap_schedule", True):
        log.info("sglang-sparse samkv: overlap scheduler disabled (config overlap_schedule false)")
        args.disable_overlap_schedule = True
    _prefill_graph_requirements(args, ctx)


def _device_type(device: Optional[str]) -> str:
    if device:
        return str(device).split(":")[0]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_hooks_applied() -> None:
    from sglang_sparse.plugin import check_hooks_applied

    check_hooks_applied()


def prepare_server_args_hook(original, argv, *args, **kwargs):
    """AROUND ``prepare_server_args``: a bad sparse config ends the CLI like argparse does (exit 2)."""
    try:
        return original(argv, *args, **kwargs)
    except SparseConfigError as e:
        print(f"sglang: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
