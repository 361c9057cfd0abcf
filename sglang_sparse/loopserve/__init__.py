"""``--sparse loopserve`` (and the decode machinery ``lastwindow`` shares): LoopServe online vertical/slash
prefill and progressive top-B decode.

Modules: ``backend`` (backend wrapper), ``runner`` (per-batch compute, reference or kernels), ``select`` (line
and top-B selection), ``graph`` (decode CUDA graphs), ``ws`` (working-set records for the host tier), ``radix``
(per-turn line sets on radix nodes), ``stats`` (per-step rows, /server_info and /metrics).
"""
