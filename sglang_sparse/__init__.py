"""sglang-sparse: sparse attention modes for stock SGLang 0.5.17 (LoopServe, PSA, SparseServe, SamKV).

Installed as a plugin (entry point group ``sglang.srt.plugins`` -> :func:`plugin`), it adds
``--sparse MODE`` and ``--sparse-config JSON|@file`` to ``python -m sglang.launch_server``
and ``sgl.Engine``. This is the only package of the project that imports sglang.
"""

__version__ = "0.1.0"


def plugin() -> None:
    """Entry point called by SGLang's ``load_plugins()`` in each process."""
    from sglang_sparse.plugin import register

    register()
