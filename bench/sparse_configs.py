"""``--sparse-config MODE=JSON`` of the bench drivers (``bench.load``, ``bench.soak``, ``bench.decode_profile``,
``bench.run_harness``, ``bench.host_profile``): one parser, so every driver refuses the same mistakes before it
starts a server.

Each item is ``MODE=VALUE``, where VALUE is what the server's own ``--sparse-config`` takes (a JSON object or
``@file.json``). Refused with a ``ValueError`` that names the item: no ``=``, an unknown mode or ``off`` (it has
no config), a mode given twice, a mode outside ``modes`` (where the driver passes the modes it runs), and a
value the mode's config class rejects (bad JSON, an unknown field, a value out of range).
"""

from __future__ import annotations

from typing import Iterable

from sglang_sparse.config import SparseConfigError
from sglang_sparse.modes import MODES, resolve_sparse

__all__ = ["parse_mode_configs"]


def parse_mode_configs(items: Iterable[str], modes: Iterable[str] | None = None) -> dict[str, str]:
    """``{mode: value}`` of the ``--sparse-config`` items, each value validated by its mode's config class."""
    allowed = None if modes is None else [m for m in modes]
    out: dict[str, str] = {}
    for item in items:
        mode, sep, text = item.partition("=")
        mode = mode.strip()
        if not sep or not mode:
            raise ValueError(f"--sparse-config {item!r}: expected MODE=JSON, e.g. psa='{{\"epsilon\": 0.9}}'")
        if mode == "off" or mode not in MODES:
            raise ValueError(f"--sparse-config {item!r}: {mode!r} is not a sparse mode with a config; one of "
                             f"{', '.join(m for m in MODES if m != 'off')}")
        if allowed is not None and mode not in allowed:
            raise ValueError(f"--sparse-config {item!r}: mode {mode!r} is not among the modes run "
                             f"({', '.join(allowed)})")
        if mode in out:
            raise ValueError(f"--sparse-config: mode {mode!r} is given twice ({out[mode]!r} and {text!r})")
        try:
            resolve_sparse(mode, text)
        except SparseConfigError as e:
            raise ValueError(f"--sparse-config {mode}=...: {e}") from None
        out[mode] = text
    return out
