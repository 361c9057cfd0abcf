"""``--sparse samkv``: per-document KV reuse with SamKV block selection and selective recompute.

Modules: ``api`` (the ``documents`` request field on the OpenAI front door), ``dsl`` (frontend DSL helper),
``assembly`` (the scheduler-side composite of cached documents), ``keys`` (document cache keys), ``select``
(block selection), ``recompute`` (selective recompute), ``side`` (side forwards), ``graph`` (their CUDA
graphs), ``stats`` (per-request report, /server_info and /metrics).
"""
