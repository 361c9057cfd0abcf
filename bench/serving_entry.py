"""Entry point that runs ``sglang.benchmark.serving`` as ``__main__``.

SGLang's dataset registry imports every dataset loader at import time, and the MMMU
loader needs the HF ``datasets`` package, which minimal environments (the CPU test venv)
lack. We use only the offline ``random`` dataset, so when ``datasets`` is missing this
installs a stub module whose ``load_dataset`` raises; otherwise it changes nothing.
"""

from __future__ import annotations

import runpy
import sys
import types


def _stub_datasets() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        mod = types.ModuleType("datasets")

        def load_dataset(*a, **k):
            raise RuntimeError("HF 'datasets' is not installed; only offline datasets work here")

        mod.load_dataset = load_dataset
        sys.modules["datasets"] = mod


if __name__ == "__main__":
    _stub_datasets()
    runpy.run_module("sglang.benchmark.serving", run_name="__main__", alter_sys=True)
