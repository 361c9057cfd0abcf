"""Per-request sparse options: ``custom_params["sparse"]`` of a request, validated and clamped.

Clients pass them through SGLang's ``custom_params`` sampling field, which every front door
carries to the scheduler: the OpenAI API as ``extra_body={"custom_params": {"sparse":
{"epsilon": 0.9}}}``, the native ``/generate`` as ``sampling_params.custom_params``.

Validation runs in the server's main process (a hook after ``SamplingParams.verify``), so a
bad value is answered with HTTP 400 before the request reaches the scheduler. In-range values
below the server's floor are clamped to it (the floor is a server limit, e.g. PSA's
``min_request_epsilon``) and the effective value is written back, so the scheduler reads a
value it can use as is. No sglang import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from sglang_sparse.config import PsaConfig, SparseConfig, json_type_name, num_text

KEY = "sparse"


@dataclass(frozen=True)
class RequestOption:
    """One per-request knob: its open/closed range and the server config field that floors it."""

    name: str
    lo: float
    hi: float
    floor_field: str | None = None
    doc: str = ""
    ceil_field: str | None = None
    integer: bool = False


# mode -> the per-request knobs it accepts (registry, no if-chains)
REQUEST_OPTIONS: Mapping[str, tuple[RequestOption, ...]] = {
    "psa": (RequestOption("epsilon", 0.0, 1.0, "min_request_epsilon",
                          "kept-mass threshold in (0, 1]; 1.0 = dense decode for this request"),),
    "loopserve": (
        RequestOption("alpha", 0.0, 1.0, "min_request_alpha",
                      "covered fraction of the sampled attention mass in (0, 1]; 1.0 = dense for this request"),
        RequestOption("budget", 0, 1 << 24, doc="top-B tokens per KV head in decode, an integer >= 1",
                      ceil_field="max_request_budget", integer=True),
    ),
}


class RequestParamsError(ValueError):
    """A bad per-request sparse option (HTTP 400 through SGLang's ValueError handling)."""


def normalize_request_options(mode: str, config: SparseConfig, custom_params: Any) -> dict[str, float] | None:
    """Validate ``custom_params["sparse"]`` for the server's mode; return the effective options.

    Returns ``None`` when the request has no sparse options. Raises :class:`RequestParamsError`
    naming the field, the value and the allowed range. Values below the server floor are clamped.
    """
    if not isinstance(custom_params, Mapping) or KEY not in custom_params:
        return None
    raw = custom_params[KEY]
    allowed = REQUEST_OPTIONS.get(mode, ())
    if not allowed:
        raise RequestParamsError(
            f"custom_params.sparse: this server runs --sparse {mode}, which takes no per-request options")
    if not isinstance(raw, Mapping):
        raise RequestParamsError(f"custom_params.sparse must be an object like {{\"epsilon\": 0.9}}, "
                                 f"got {type(raw).__name__}")
    by_name = {o.name: o for o in allowed}
    unknown = sorted(set(raw) - set(by_name))
    if unknown:
        raise RequestParamsError(f"custom_params.sparse: unknown key(s) {', '.join(map(repr, unknown))} for "
                                 f"mode '{mode}'; allowed: {', '.join(sorted(by_name))}")
    out: dict[str, float] = {}
    for name, value in raw.items():
        opt = by_name[name]
        kind = "an integer" if opt.integer else "a number"
        where = f"custom_params.sparse.{name} = {value!r}"
        allowed = (f"[{int(opt.lo) + 1}, {num_text(opt.hi)}]" if opt.integer and float(opt.lo).is_integer()
                   else f"({num_text(opt.lo)}, {num_text(opt.hi)}]")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestParamsError(f"{where} must be {kind} in {allowed}, got {json_type_name(value)} ({opt.doc})")
        if not math.isfinite(value) or not (opt.lo < value <= opt.hi):
            raise RequestParamsError(f"{where} is out of range: expected {kind} in {allowed} ({opt.doc})")
        if opt.integer and not float(value).is_integer():
            raise RequestParamsError(f"{where} is not an integer: expected an integer in {allowed} ({opt.doc})")
        value = int(value) if opt.integer else float(value)
        if opt.floor_field is not None:
            value = max(value, type(value)(getattr(config, opt.floor_field)))
        if opt.ceil_field is not None:
            value = min(value, type(value)(getattr(config, opt.ceil_field)))
        out[name] = value
    return out


def request_epsilon(config: PsaConfig, custom_params: Any) -> float:
    """The epsilon a (validated) request decodes with: its own, else the server's ``epsilon``."""
    if isinstance(custom_params, Mapping):
        opts = custom_params.get(KEY)
        if isinstance(opts, Mapping) and "epsilon" in opts:
            return float(opts["epsilon"])
    return float(config.epsilon)
