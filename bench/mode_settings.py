"""Which settings a headline row ran under: the ``mode_configs`` of the headline JSONs (``fidelity_long.json``,
``e2e_long.json``, ``reliability.json``) and the row labels built from them.

A headline's ``mode_configs`` maps a mode to the config its server ran (as the server reported it in
``/server_info``, or the settings known to matter for rows measured before servers reported it). A row is
labelled with the keys whose values differ from the mode's *current* defaults, so a row measured at an old default
stays labelled after the default moves, and a row at today's defaults keeps the bare mode name.
"""

from __future__ import annotations

from sglang_sparse.modes import MODES

__all__ = ["settings_diff", "mode_label", "reported_config"]


def settings_diff(mode: str, config: dict | None) -> dict:
    """The entries of ``config`` that differ from ``mode``'s current defaults (all of them for an unknown mode)."""
    spec = MODES.get(mode)
    default = spec.config_cls() if spec is not None and spec.config_cls is not None else None
    return {k: v for k, v in (config or {}).items() if default is None or getattr(default, k, v) != v}


def mode_label(doc: dict, mode: str) -> str:
    """``mode``, followed by the settings of its rows that differ from today's defaults (``doc["mode_configs"]``),
    e.g. ``lastwindow (min_context 4096)``."""
    diff = settings_diff(mode, (doc.get("mode_configs") or {}).get(mode))
    return f"{mode} ({', '.join(f'{k} {v}' for k, v in diff.items())})" if diff else mode


def reported_config(server_info: dict | None) -> dict | None:
    """The sparse config a server reports in ``/server_info`` (``internal_states[0].sparse.config``), or None."""
    states = (server_info or {}).get("internal_states") or [{}]
    cfg = ((states[0] or {}).get("sparse") or {}).get("config")
    return cfg if isinstance(cfg, dict) else None
