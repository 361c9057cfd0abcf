"""Hooks that run inside SGLang's scheduler process (scheduler and model runner).

They hand the resolved :class:`~sglang_sparse.modes.SparseContext` to the scheduler and
to the attention backend, and report it through ``/server_info`` (``internal_states``),
so a client can check which mode, config and backend the scheduler process really runs.
"""

from __future__ import annotations

import logging
import os

from sglang_sparse.deterministic import plan_eager_decode_like_replay
from sglang_sparse.mode_spec import resolve
from sglang_sparse.modes import sparse_context_of

logger = logging.getLogger("sglang_sparse")


def scheduler_init_hook(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: attach the context and check the mode got its backend."""
    from sglang_sparse.plugin import check_hooks_applied

    check_hooks_applied()
    ctx = sparse_context_of(scheduler.server_args)
    scheduler.sparse_context = ctx
    from sglang_sparse.host_tier.admission import make_admission

    scheduler.sparse_ws_admission = make_admission(scheduler)
    backend = _attention_backend(scheduler)
    if ctx.spec.backend_installer and getattr(backend, "sparse_installed_mode", None) != ctx.mode:
        raise RuntimeError(f"sglang-sparse: mode '{ctx.mode}' was not installed into the attention backend "
                           f"({type(backend).__name__}); refusing to serve it densely")
    # state a mode keeps on the radix cache, where its RadixCache hooks find it (loopserve's line store)
    for name, state in (getattr(backend, "sparse_tree_state", None) or {}).items():
        setattr(scheduler.tree_cache, name, state)
    logger.info("sglang-sparse: scheduler pid %d runs mode=%s config=%s on %s", os.getpid(), ctx.mode,
                ctx.config.to_json(), type(backend).__name__)


def attention_backend_hook(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backends``: give the backend(s) the context."""
    ctx = sparse_context_of(model_runner.server_args)
    install = None
    if ctx.spec.backend_installer:
        install = resolve(ctx.spec.backend_installer)
    seen = set()
    reach = engagement(ctx, model_runner)  # once (warned once) for the backend(s) below
    dormant = install is not None and reach is not None and not reach["reachable"]
    for name in ("attn_backend", "decode_attn_backend"):
        backend = getattr(model_runner, name, None)
        if backend is None or id(backend) in seen:
            continue
        seen.add(id(backend))
        if dormant:  # nothing of the mode could ever run: serve exactly as --sparse off does
            backend.sparse_installed_mode = ctx.mode
        elif install is not None:
            args = model_runner.server_args
            install(backend, ctx.config, args.page_size, bool(args.enable_metrics), model_runner=model_runner)
            # stock rows of batches the mode runs eagerly must decode as off's replayed graphs do
            plan_eager_decode_like_replay(backend)
        backend.sparse_context = ctx
        backend.sparse_engagement = None if reach is None else {**reach, "dormant": dormant}


def engagement(ctx, model_runner) -> dict | None:
    """Whether the mode's ``min_context`` is reachable on this server: ``{"min_context", "context_length",
    "longest_sequence", "reachable"}``, or None (a mode without ``min_context``, or no served length known).

    The longest sequence (prompt + output tokens) a request can reach is SGLang's ``max_req_len``,
    ``min(context_len, max_total_num_tokens) - 1`` (``TpModelWorker``; the scheduler clamps ``max_new_tokens`` below
    it, the tokenizer refuses longer prompts). No request option lowers ``min_context``, so a value above it means the
    mode never engages: :func:`attention_backend_hook` leaves it dormant (nothing installed, the stock attention
    serves every request). Logged as a warning at start-up, reported in ``/server_info``
    (``internal_states[0].sparse.engagement``, with ``dormant``)."""
    mc = getattr(ctx.config, "min_context", None)
    served = getattr(getattr(model_runner, "model_config", None), "context_len", None)
    if mc is None or not served:
        return None
    pool = getattr(model_runner, "max_total_num_tokens", None)
    longest = min(int(served), pool if isinstance(pool, int) and pool > 0 else int(served)) - 1
    got = {"min_context": int(mc), "context_length": int(served), "longest_sequence": longest,
           "reachable": int(mc) <= longest}
    if not got["reachable"]:
        logger.warning("sglang-sparse %s: min_context %d is above the longest sequence a request can reach here (%d "
                       "tokens; served context length %d), so the mode is dormant: nothing of it is installed and "
                       "every request is served by the stock attention, as with --sparse off; set a lower "
                       "min_context in --sparse-config to engage the mode", ctx.mode, got["min_context"], longest,
                       got["context_length"])
    return got


def internal_state_hook(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: add ``sparse`` to the reply."""
    ctx = getattr(scheduler, "sparse_context", None)
    backend = _attention_backend(scheduler)
    backend_ctx = getattr(backend, "sparse_context", None)
    result.internal_state["sparse"] = {
        "plugin_pid": os.getpid(),
        "mode": None if ctx is None else ctx.mode,
        "config": None if ctx is None else ctx.config.to_dict(),
        "attention_backend": type(backend).__name__,
        "attention_backend_mode": None if backend_ctx is None else backend_ctx.mode,
        "engagement": getattr(backend, "sparse_engagement", None),
        "stats": stats.to_dict() if (stats := getattr(backend, "sparse_stats", None)) is not None else None,
        "host_tier": tier.report() if (tier := getattr(getattr(scheduler, "tree_cache", None), "tier", None))
        is not None else None,
        "working_set": adm.report() if (adm := getattr(scheduler, "sparse_ws_admission", None)) is not None
        else None,
        "samkv": rt.stats.to_dict() if (rt := getattr(getattr(scheduler, "tree_cache", None), "samkv_runtime",
                                                      None)) is not None else None,
    }
    return result


def _attention_backend(scheduler):
    return scheduler.tp_worker.model_runner.attn_backend
