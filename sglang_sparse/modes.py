"""The ``--sparse`` mode registry and the resolved :class:`SparseContext`.

A mode is an explicit :class:`~sglang_sparse.mode_spec.SparseModeSpec` (the mode interface: config class,
installer, per-request options, step statistics), defined by its sub-package (``sglang_sparse/<mode>/spec.py``)
and registered here by name. :func:`resolve_sparse` turns the raw ``--sparse`` and ``--sparse-config`` values
into a :class:`SparseContext`, refusing a mode that is not implemented yet (listing the implemented ones)
instead of falling back to dense. No sglang import.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from sglang_sparse.config import OffConfig, SparseConfigError, _duplicate_key_hook
from sglang_sparse.lastwindow.spec import SPEC as LASTWINDOW
from sglang_sparse.loopserve.spec import SPEC as LOOPSERVE
from sglang_sparse.mode_spec import SparseModeSpec
from sglang_sparse.psa.spec import SPEC as PSA
from sglang_sparse.samkv.spec import SPEC as SAMKV

__all__ = ["MODES", "SparseModeSpec", "SparseContext", "resolve_sparse", "sparse_context_of"]


def _registry(*specs: SparseModeSpec) -> Mapping[str, SparseModeSpec]:
    return MappingProxyType({s.name: s for s in specs})


OFF = SparseModeSpec("off", OffConfig, "dense attention and the stock radix cache", implemented=True)

MODES: Mapping[str, SparseModeSpec] = _registry(OFF, PSA, LOOPSERVE, LASTWINDOW, SAMKV)


def implemented_modes() -> list[str]:
    return [n for n, s in MODES.items() if s.implemented]


def check_mode(name: Any) -> str:
    """Return ``name`` if it is an implemented mode, else raise with the list of implemented ones."""
    impl = ", ".join(implemented_modes())
    if not isinstance(name, str):
        raise SparseConfigError(f"--sparse must be a mode name (string), got {type(name).__name__}; "
                                f"implemented modes: {impl}")
    spec = MODES.get(name)
    if spec is None:
        raise SparseConfigError(f"unknown --sparse mode '{name}'; implemented modes: {impl}")
    if not spec.implemented:
        raise SparseConfigError(f"--sparse mode '{name}' ({spec.summary}) is not implemented yet; "
                                f"implemented modes: {impl}")
    return name


def check_device(name: str, device: str) -> None:
    """Refuse a mode on a device type it does not run on yet (never a silent dense fallback)."""
    spec = MODES[name]
    if device not in spec.devices:
        raise SparseConfigError(f"--sparse mode '{name}' runs on {', '.join(spec.devices)} only so far; "
                                f"this server's device is '{device}'")


def load_config_arg(value: Any) -> dict[str, Any]:
    """Parse a ``--sparse-config`` value: a JSON object, ``@path.json``, a dict, or None/empty."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise SparseConfigError(f"--sparse-config must be a JSON object string, '@file.json' or a dict, "
                                f"got {type(value).__name__}")
    text, source = value.strip(), "--sparse-config"
    if not text:
        return {}
    if text.startswith("@"):
        path = os.path.expanduser(text[1:])
        source = f"--sparse-config file '{path}'"
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as e:
            raise SparseConfigError(f"{source} cannot be read: {e.strerror or e}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_duplicate_key_hook(source))  # a repeated key is an error
    except json.JSONDecodeError as e:
        raise SparseConfigError(f"{source} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(obj, dict):
        raise SparseConfigError(f"{source} must be a JSON object like '{{\"key\": value}}', got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class SparseContext:
    """What every sglang-sparse component receives: the mode's spec and its validated config."""

    mode: str
    config: SparseConfig

    def __post_init__(self) -> None:
        if MODES.get(self.mode) is None or not isinstance(self.config, MODES[self.mode].config_cls):
            raise SparseConfigError(f"SparseContext: config {type(self.config).__name__} does not belong "
                                    f"to mode '{self.mode}'")

    @property
    def spec(self) -> SparseModeSpec:
        return MODES[self.mode]

    @property
    def is_dense(self) -> bool:
        return self.mode == "off"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "config": self.config.to_dict()}


def resolve_sparse(mode: Any, config: Any = None) -> SparseContext:
    """Validate ``--sparse`` then ``--sparse-config``; raise :class:`SparseConfigError` on any fault."""
    name = check_mode(mode)
    return SparseContext(name, MODES[name].config_cls.from_dict(load_config_arg(config)))


@functools.lru_cache(maxsize=8)
def _context_from(mode: str, config_json: Any) -> SparseContext:
    return resolve_sparse(mode, config_json)


def sparse_context_of(server_args) -> SparseContext:
    """The :class:`SparseContext` of a (resolved) ServerArgs; dense if the plugin's fields are absent."""
    return _context_from(getattr(server_args, "sparse", "off"), getattr(server_args, "sparse_config", None))


def modes_help() -> str:
    lines = []
    for s in MODES.values():
        state = "" if s.implemented else " [not implemented yet]"
        lines.append(f"'{s.name}': {s.summary}{state}")
    return "; ".join(lines)
