"""Host KV tier (SparseServe): radix nodes evicted from the GPU kept in pinned host memory, and
working-set-aware admission.

Modules: ``cache`` (the radix-cache backend and server-args wiring), ``admission`` (scheduler admission
hooks bounded by the GPU unit cache).
"""
