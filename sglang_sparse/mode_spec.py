"""The mode interface: what one ``--sparse`` mode declares (no sglang import, no heavy import).

Each mode sub-package (``sglang_sparse/<mode>/spec.py``) defines one :class:`SparseModeSpec`;
:mod:`sglang_sparse.modes` registers them by name. A spec says:

* its config: ``config_cls`` (a frozen :class:`~sglang_sparse.config.SparseConfig`, defaults declared there);
* what it installs into SGLang: ``backend_installer`` (``"module:function"``, called in the scheduler process as
  ``fn(backend, config, page_size, enable_metrics, model_runner=...)``; None keeps the stock backend);
* its per-request options: ``request_options`` (:class:`RequestOption`, validated in the main process by
  :func:`sglang_sparse.request_params.normalize_request_options` and read in the scheduler by
  :func:`sglang_sparse.request_params.request_values`, the one reader of every mode);
* its per-step statistics: ``step_report`` (:class:`StepReport`: the backend method returning a forward's
  :class:`~sglang_sparse.stats.StepRows`, the ``meta_info`` key and the per-request summary), carried by
  :mod:`sglang_sparse.api_hooks` for every mode the same way.

Kernel vs reference is the config's ``runner`` knob (:func:`sglang_sparse.config.uses_kernels`), an explicit
argument of each runner; there is no environment switch. References to code are ``"module:attr"`` strings,
resolved with :func:`resolve`, so registering a mode imports nothing heavy and makes no import circle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from sglang_sparse.config import SparseConfig


@dataclass(frozen=True)
class RequestOption:
    """One per-request knob (``custom_params["sparse"][name]``): its open/closed range ``(lo, hi]``, the server
    config field giving its default (``default_field``), and the fields that floor / ceil it."""

    name: str
    lo: float
    hi: float
    floor_field: str | None = None
    doc: str = ""
    ceil_field: str | None = None
    integer: bool = False
    default_field: str | None = None


@dataclass(frozen=True)
class StepReport:
    """Per-step statistics of a mode's attention backend: ``backend_method`` (a backend attribute returning this
    forward's :class:`~sglang_sparse.stats.StepRows` or None), ``key`` (the ``customized_info`` / ``meta_info`` key
    they travel under), ``summarize`` (``"module:function"``: the request's rows -> its ``metadata["sparse"]``)."""

    backend_method: str
    key: str
    summarize: str


@dataclass(frozen=True)
class SparseModeSpec:
    """One ``--sparse`` mode (see the module docstring).

    ``implemented`` False means the name is reserved for a planned mode and is refused at start-up;
    ``devices`` are the device types the mode runs on (others are refused).
    """

    name: str
    config_cls: type[SparseConfig]
    summary: str
    implemented: bool
    devices: tuple[str, ...] = ("cpu", "cuda")
    backend_installer: str | None = None
    request_options: tuple[RequestOption, ...] = ()
    step_report: StepReport | None = None

    def __post_init__(self) -> None:
        if self.config_cls.mode != self.name:
            raise ValueError(f"SparseModeSpec '{self.name}': config_cls.mode is '{self.config_cls.mode}'")
        for o in self.request_options:
            for f in (o.floor_field, o.ceil_field, o.default_field):
                if f is not None and f not in self.config_cls.__dataclass_fields__:
                    raise ValueError(f"SparseModeSpec '{self.name}': request option '{o.name}' names config "
                                     f"field '{f}', which {self.config_cls.__name__} lacks")


def resolve(ref: str) -> Any:
    """``"package.module:attr"`` -> the attribute (imports the module)."""
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)
