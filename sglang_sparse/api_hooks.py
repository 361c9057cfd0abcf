"""Hooks on SGLang's request path: per-request options in, per-request statistics out.

* ``SamplingParams.verify`` (main process, every front door): validates and clamps
  ``custom_params["sparse"]`` against the server's mode (:mod:`sglang_sparse.request_params`);
  a ``ValueError`` there is SGLang's HTTP 400.
* ``ForwardBatch.init_new`` (scheduler process): the rows' ``Req`` objects onto the sampling info.
* ``DecodeCudaGraphRunner.can_run_graph`` (scheduler process): a sparse batch replays the mode's sparse
  graph, a batch without a sparse row the stock graph (:mod:`sglang_sparse.graph_variants`); others run eagerly.
* ``ModelRunner.forward`` (scheduler process): hands the attention backend's step rows to
  SGLang as ``logits_output.customized_info`` (see :mod:`sglang_sparse.psa.stats`); SGLang
  carries them to the request's ``meta_info[STEP_KEY]`` (one row per output token).
* ``OpenAIServingChat._build_chat_response`` / ``OpenAIServingCompletion._build_completion_response``
  (main process): add the per-request summary as ``metadata["sparse"]`` of the response (a list
  when ``n > 1``), and as ``meta_info["sparse"]`` of each choice when ``return_meta_info`` is set.
"""

from __future__ import annotations

from sglang_sparse.mode_spec import resolve
from sglang_sparse.modes import MODES, sparse_context_of
from sglang_sparse.request_params import host_ints, normalize_request_options


def _step_sources() -> tuple:
    """Per-step statistics of every mode, from the modes' specs (``step_report``), one entry per key: (backend
    method returning this forward's StepRows, the customized_info / meta_info key they travel under, the
    per-request summary of those rows)."""
    seen, out = set(), []
    for spec in MODES.values():
        r = spec.step_report
        if r is not None and r.key not in seen:
            seen.add(r.key)
            out.append((r.backend_method, r.key, resolve(r.summarize)))
    return tuple(out)


STEP_SOURCES = _step_sources()


def verify_hook(result, sampling_params, *args, **kwargs):
    """AFTER ``SamplingParams.verify``: check ``custom_params.sparse``; write back the clamped values."""
    from sglang.srt.server_args import get_global_server_args

    custom = getattr(sampling_params, "custom_params", None)
    if not isinstance(custom, dict) or "sparse" not in custom:
        return result
    ctx = sparse_context_of(get_global_server_args())
    opts = normalize_request_options(ctx.mode, ctx.config, custom)
    sampling_params.custom_params = {**custom, "sparse": opts}
    return result


def forward_batch_hook(result, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: hand the rows' ``Req`` objects to the attention backend as
    ``forward_batch.sampling_info.sparse_reqs`` (the sampling info, unlike extra ForwardBatch
    attributes, survives the runner's copy of the batch into its static buffers). Set afresh for
    every forward, so it is always aligned with the rows. Modes read per-request options from it."""
    batch = next((a for a in args if hasattr(a, "reqs") and hasattr(a, "forward_mode")), None)
    info = getattr(result, "sampling_info", None)
    if batch is not None and info is not None and batch.reqs is not None:
        info.sparse_reqs = batch.reqs
    return result


def graph_gate_hook(result, graph_runner, forward_batch, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner.can_run_graph``: under psa, replay a decode graph only for
    batches with at least one sparse row (those graphs were captured over the PSA path); under
    loopserve / lastwindow only for steady steps (``sglang_sparse.loopserve.graph``); other
    batches run eagerly."""
    if not result:
        return result
    backend = getattr(getattr(graph_runner, "model_runner", None), "attn_backend", None)
    variant = getattr(backend, "sparse_graph_variant", None)
    if variant is not None:  # sparse graph for sparse batches, stock graph (when recorded) for dense ones
        from sglang_sparse.graph_variants import dual_capture, select_capture

        v = variant(forward_batch)
        return v == "sparse" or (v == "dense" and dual_capture(graph_runner)) \
            or (v == "select" and select_capture(graph_runner))
    wants = getattr(backend, "sparse_wants_graph", None)  # the mode's gate (psa, loopserve, lastwindow)
    return result if wants is None else bool(wants(forward_batch))


def prefill_graph_gate_hook(result, graph_runner, forward_batch, *args, **kwargs):
    """AFTER ``PrefillCudaGraphRunner.can_run_graph``: under loopserve / lastwindow (backends that set
    ``sparse_prefill_graph_below``) an extend batch replays SGLang's prefill graph only when no row reaches the
    mode's ``min_context`` (the whole batch runs the stock prefill, as under ``off``); a batch with a long row
    (sparse prefill, line reuse) runs eagerly, exactly as with prefill graphs off. Other modes (psa, whose prefill
    probe runs inside the eager attention calls of the breakable prefill graphs): SGLang's answer, told to the
    backend's ``sparse_note_prefill_graph(forward_batch)`` when it has one (statistics)."""
    if not result:
        return result
    backend = getattr(getattr(graph_runner, "model_runner", None), "attn_backend", None)
    min_context = getattr(backend, "sparse_prefill_graph_below", None)
    if min_context is None:
        note = getattr(backend, "sparse_note_prefill_graph", None)
        if callable(note):
            note(forward_batch)
        return result
    return not prefill_reaches(forward_batch, int(min_context))


def prefill_reaches(forward_batch, min_context: int) -> bool:
    """Whether a row of this extend batch ends at ``min_context`` tokens or beyond (host ints, no sync)."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    if lens is None:  # no host copy: ask for the eager path rather than read the device
        return True
    bs = int(getattr(forward_batch, "batch_size", len(lens)) or len(lens))
    return bool(len(lens)) and max(host_ints(lens, bs), default=0) >= min_context


def model_forward_hook(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.forward``: attach the sparse mode's step rows of this forward to the logits output."""
    backend = getattr(model_runner, "attn_backend", None)
    logits = getattr(result, "logits_output", None)
    if backend is None or logits is None or not hasattr(logits, "customized_info"):
        return result
    for method, key, _ in STEP_SOURCES:
        fn = getattr(backend, method, None)
        rows = fn() if fn is not None else None
        if rows is not None:
            if logits.customized_info is None:
                logits.customized_info = {}
            logits.customized_info[key] = rows
    return result


def request_summary(meta_info: dict | None) -> dict | None:
    """The per-request report of whichever sparse mode left step rows in ``meta_info``."""
    meta_info = meta_info or {}
    for _, key, summarize in STEP_SOURCES:
        if meta_info.get(key):
            return summarize(meta_info[key])
    return None


def _attach(response, ret, request):
    metadata = getattr(response, "metadata", None)
    if not hasattr(response, "choices") or not ret:
        return response
    summaries = [request_summary(item.get("meta_info")) for item in ret]
    if all(s is None for s in summaries):
        return response
    response.metadata = {**(metadata or {}), "sparse": summaries[0] if len(summaries) == 1 else summaries}
    if getattr(request, "return_meta_info", False):
        for choice, s in zip(response.choices, summaries):
            if isinstance(getattr(choice, "meta_info", None), dict) and s is not None:
                choice.meta_info = {**choice.meta_info, "sparse": s}
    return response


def chat_response_hook(result, serving, request, ret, *args, **kwargs):
    """AFTER ``OpenAIServingChat._build_chat_response``."""
    return _attach(result, ret, request)


def completion_response_hook(result, serving, request, ret, *args, **kwargs):
    """AFTER ``OpenAIServingCompletion._build_completion_response``."""
    return _attach(result, ret, request)
