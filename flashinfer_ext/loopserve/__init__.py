"""LoopServe kernels: vertical/slash line estimation (``vs_estimate*``, ``vs_lse_split``, ``vs_common``),
alpha-coverage selection and decode top-B (``vs_select``, ``vs_split_search``), sparse prefill
(``vs_prefill``), decode-list union (``list_union``) and their torch references (``reference``).
"""
