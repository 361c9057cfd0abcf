"""Entry point of group ``sglang.srt.plugins``: installs sglang-sparse into stock SGLang.

SGLang calls :func:`register` (through ``load_plugins()``) in the main process and in
every scheduler process, then applies the hooks. ``HookRegistry`` logs and continues
when a hook fails to apply, so :func:`check_hooks_applied` is called at start-up (in
``SparseServerArgs.__post_init__`` and in the scheduler hook) and raises instead.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_sparse")

# (target, hook type name, "module:attribute" of the hook); the order is irrelevant.
_HOOKS = (
    ("sglang.srt.server_args.ServerArgs", "REPLACE", "sglang_sparse.server_args:SparseServerArgs"),
    ("sglang.srt.entrypoints.engine.Engine.server_args_class", "REPLACE",
     "sglang_sparse.server_args:SparseServerArgs"),
    ("sglang.srt.server_args.prepare_server_args", "AROUND", "sglang_sparse.server_args:prepare_server_args_hook"),
    ("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", "sglang_sparse.runtime_hooks:scheduler_init_hook"),
    ("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "AFTER",
     "sglang_sparse.runtime_hooks:internal_state_hook"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends", "AFTER",
     "sglang_sparse.runtime_hooks:attention_backend_hook"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "AFTER",
     "sglang_sparse.api_hooks:forward_batch_hook"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph", "AFTER",
     "sglang_sparse.api_hooks:graph_gate_hook"),
    ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph", "AFTER",
     "sglang_sparse.api_hooks:prefill_graph_gate_hook"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture", "AROUND",
     "sglang_sparse.graph_variants:capture_hook"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner._resolve_lora_variant", "AROUND",
     "sglang_sparse.graph_variants:resolve_variant_hook"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape", "AROUND",
     "sglang_sparse.graph_variants:capture_one_shape_hook"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward", "AFTER", "sglang_sparse.api_hooks:model_forward_hook"),
    ("sglang.srt.sampling.sampling_params.SamplingParams.verify", "AFTER", "sglang_sparse.api_hooks:verify_hook"),
    ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response", "AFTER",
     "sglang_sparse.api_hooks:chat_response_hook"),
    ("sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response", "AFTER",
     "sglang_sparse.api_hooks:completion_response_hook"),
    # every mode: 'documents' on the native /generate is a 400, not ignored
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__", "AFTER",
     "sglang_sparse.http_guard:tokenizer_manager_init_hook"),
    # --sparse loopserve (no-ops under other modes)
    ("sglang.srt.mem_cache.radix_cache.RadixCache.cache_unfinished_req", "AFTER",
     "sglang_sparse.loopserve.radix:cache_req_hook"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req", "AFTER",
     "sglang_sparse.loopserve.radix:cache_req_hook"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache._split_node", "AFTER", "sglang_sparse.loopserve.radix:split_hook"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache._delete_leaf", "AFTER",
     "sglang_sparse.loopserve.radix:delete_leaf_hook"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache.reset", "AFTER", "sglang_sparse.loopserve.radix:reset_hook"),
    # --sparse samkv (no-ops under other modes / for requests without documents)
    ("sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request", "AROUND",
     "sglang_sparse.samkv.api:handle_request_hook"),
    ("sglang.srt.managers.schedule_batch.Req.init_next_round_input", "AFTER",
     "sglang_sparse.samkv.assembly:init_round_hook"),
    ("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", "sglang_sparse.samkv.assembly:scheduler_init_hook"),
    # host tier: working-set-aware admission (a no-op unless psa | loopserve + host_tier_gb > 0 + working_set_admission)
    ("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill", "AROUND",
     "sglang_sparse.host_tier.admission:new_batch_prefill_hook"),
    ("sglang.srt.managers.scheduler.Scheduler.get_num_allocatable_reqs", "AFTER",
     "sglang_sparse.host_tier.admission:allocatable_hook"),
)


def hook_targets() -> tuple[str, ...]:
    return tuple(t for t, _, _ in _HOOKS)


def register() -> None:
    """Register every hook with SGLang's HookRegistry (applied by ``load_plugins``)."""
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, kind, ref in _HOOKS:
        module, attr = ref.split(":")
        HookRegistry.register(target, getattr(importlib.import_module(module), attr), HookType[kind])
    from sglang_sparse.host_tier.cache import register_backend

    register_backend()  # radix-cache backend of the host tier (selected only when host_tier_gb > 0)
    logger.info("sglang-sparse: registered %d hooks", len(_HOOKS))


def check_hooks_applied() -> None:
    """Raise if any sglang-sparse hook was not applied (SGLang only logs such failures)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in hook_targets() if t not in HookRegistry._patched]
    if missing:
        raise RuntimeError(
            "sglang-sparse: these SGLang hooks did not apply (see the 'Failed to apply hooks' log above; "
            f"is sglang 0.5.17 installed?): {', '.join(missing)}")
