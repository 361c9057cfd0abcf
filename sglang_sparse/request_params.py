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
from typing import Any, Mapping, Sequence

from sglang_sparse.config import SparseConfig, json_type_name, num_text
from sglang_sparse.mode_spec import RequestOption
from sglang_sparse.modes import MODES

KEY = "sparse"

__all__ = ["KEY", "REQUEST_OPTIONS", "RequestOption", "RequestParamsError", "ReplayRequests", "batch_requests",
           "normalize_request_options", "request_epsilon", "request_values"]

# mode -> the per-request knobs it accepts (declared by each mode's spec: sglang_sparse/<mode>/spec.py)
REQUEST_OPTIONS: Mapping[str, tuple[RequestOption, ...]] = {n: s.request_options for n, s in MODES.items()
                                                            if s.request_options}


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


def _sparse_options(req_or_custom: Any) -> Mapping:
    """The validated ``custom_params["sparse"]`` of a ``Req`` (or of a ``custom_params`` mapping); ``{}`` if none."""
    custom = req_or_custom
    if not isinstance(custom, Mapping):
        custom = getattr(getattr(req_or_custom, "sampling_params", None), "custom_params", None)
    opts = custom.get(KEY) if isinstance(custom, Mapping) else None
    return opts if isinstance(opts, Mapping) else {}


def request_values(config: SparseConfig, req_or_custom: Any) -> dict[str, float | int]:
    """The per-request options a (validated) request runs with under ``config``'s mode: its own
    ``custom_params.sparse`` value for each option the mode's spec declares, else the server's default
    (the config field ``default_field``). The one reader of every mode, in the scheduler; ``req_or_custom`` is a
    ``Req`` (its ``sampling_params.custom_params``), a ``custom_params`` mapping, or None."""
    opts = _sparse_options(req_or_custom) if req_or_custom is not None else {}
    out: dict[str, float | int] = {}
    for o in REQUEST_OPTIONS.get(type(config).mode, ()):
        cast = int if o.integer else float
        if o.name in opts:
            out[o.name] = cast(opts[o.name])
        elif o.default_field is not None:
            out[o.name] = cast(getattr(config, o.default_field))
    return out


def request_epsilon(config: SparseConfig, custom_params: Any) -> float:
    """The epsilon a (validated) psa request decodes with: its own, else the server's ``epsilon``."""
    return float(request_values(config, custom_params)["epsilon"])


def host_ints(values, n: int | None = None) -> list[int]:
    """The first ``n`` (all: None) entries of a batch's host lengths as Python ints: ``seq_lens_cpu`` and friends
    are CPU tensors (one ``tolist``, not a per-element iteration, which costs a tensor per element) or lists."""
    values = values if n is None else values[:n]
    return values.tolist() if hasattr(values, "tolist") else [int(x) for x in values]


def batch_requests(forward_batch) -> Sequence | None:
    """The ``Req`` objects of a forward batch's rows (set by :func:`sglang_sparse.api_hooks.forward_batch_hook` on
    ``forward_batch.sampling_info.sparse_reqs``), or None (a batch without them: a CUDA-graph replay view, a
    capture). The one carrier of the rows' requests for every mode, eager or graph-planned."""
    return getattr(getattr(forward_batch, "sampling_info", None), "sparse_reqs", None)


class ReplayRequests:
    """The rows' ``Req`` objects across a decode CUDA-graph replay.

    SGLang asks the backend whether a batch replays a graph (``can_run_graph``) on the real batch, then plans the
    replay on a padded view without ``sampling_info``. :meth:`keep` stores the real batch's requests and host
    lengths; :meth:`recover` gives them back for a view whose first rows have those lengths (the same batch),
    else None. Modes read their per-request options from the recovered requests with :func:`request_values`.
    """

    def __init__(self) -> None:
        self._lens: list[int] | None = None
        self._reqs: tuple = ()

    def keep(self, forward_batch) -> None:
        """Store the rows' requests and ``seq_lens_cpu`` (``[bs]`` int) of a real batch (``can_run_graph``)."""
        lens, bs = forward_batch.seq_lens_cpu, int(forward_batch.batch_size)
        self._lens = None if lens is None else lens[:bs].tolist()
        self._reqs = tuple(batch_requests(forward_batch) or ())[:bs]

    def matches(self, view, bs: int) -> bool:
        """Whether the padded view ``view`` (``bs`` rows) starts with the kept batch's rows (same host lengths)."""
        lens = view.seq_lens_cpu
        if self._lens is None or lens is None:
            return False
        n = len(self._lens)
        return n <= bs and lens[:n].tolist() == self._lens

    def recover(self, view, bs: int) -> tuple[int, tuple] | None:
        """``(rows of the kept batch, their requests)`` for a replay view (no ``sampling_info``) of the kept batch,
        else None. The requests tuple is shorter than the rows when the batch carried fewer."""
        if getattr(view, "sampling_info", None) is not None or not self.matches(view, bs):
            return None
        return len(self._lens), self._reqs
