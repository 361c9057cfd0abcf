"""Mode configurations: frozen dataclasses validated field by field.

Each ``--sparse`` mode owns one frozen dataclass derived from :class:`SparseConfig`.
A field declares its allowed values in its metadata (:func:`knob`); ``__post_init__``
checks type and range and names the field, the value and the allowed range in the
error. :meth:`SparseConfig.from_dict` also rejects keys the mode does not know.

No sglang import here: the configs pass from ``sglang_sparse`` into the kernel and
cache packages as plain frozen objects, and tests import this module cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from flashinfer_ext.psa.config import PsaDecodeConfig  # plain dataclass: the kernel-side PSA defaults


class SparseConfigError(ValueError):
    """A bad ``--sparse`` / ``--sparse-config`` value (mode, JSON, key, type or range)."""


@dataclass(frozen=True)
class Range:
    """Closed or half-open numeric interval ``lo .. hi`` (``None`` = unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else num_text(self.lo)
        hi = "inf" if self.hi is None else num_text(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"


def num_text(v: float) -> str:
    """A bound as written: integers in full (``16777216``, never ``1.67772e+07``), other numbers as ``repr``."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def json_type_name(value: Any) -> str:
    """The JSON name of a decoded value's type (``null``, ``boolean``, ``string``, ...), for error messages."""
    if value is None:
        return "null"
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                    (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return name
    return type(value).__name__


def _duplicate_key_hook(source: str):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise SparseConfigError(f"{source}: key '{k}' appears more than once; give each key once")
            seen.add(k)
        return dict(pairs)

    return hook


def knob(default: Any, *, doc: str, range: Range | None = None, choices: tuple | None = None):
    """A config field: its default, one-line doc, and allowed range or choices."""
    return field(default=default, metadata={"doc": doc, "range": range, "choices": choices})


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def json_text(value: Any) -> str:
    """A decoded JSON value as JSON writes it (``null``, ``true``, ``"0.9"``), cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class SparseConfig:
    """Base of every mode's config. Subclasses add :func:`knob` fields only."""

    mode: ClassVar[str] = "?"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check_field(self.mode, f, value)
            if checked is not value:
                object.__setattr__(self, f.name, checked)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "SparseConfig":
        """Build from a JSON object; unknown keys, wrong types and bad ranges raise."""
        raw = {} if raw is None else raw
        if not isinstance(raw, Mapping):
            raise SparseConfigError(
                f"--sparse-config for mode '{cls.mode}' must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none (this mode takes no options)"
            raise SparseConfigError(
                f"--sparse-config: unknown key(s) {', '.join(repr(k) for k in unknown)} for mode "
                f"'{cls.mode}'; allowed keys: {allowed}")
        return cls(**dict(raw))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def describe(cls) -> str:
        """``key=default (range): doc`` per field, for ``--help`` and the README."""
        parts = []
        for f in dataclasses.fields(cls):
            allowed = f.metadata.get("range") or f.metadata.get("choices")
            parts.append(f"{f.name}={f.default!r} {allowed or ''}".rstrip())
        return ", ".join(parts) or "no options"


def _check_field(mode: str, f: dataclasses.Field, value: Any) -> Any:
    want = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    where = f"--sparse-config: field '{f.name}' of mode '{mode}'"
    rng: Range | None = f.metadata.get("range")
    choices = f.metadata.get("choices")
    # JSON has one number type: accept 1 for a float field, never True for a number, never 1.0 for an int
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        allowed = f" in {rng}" if rng else (f", one of {list(choices)}" if choices else "")
        raise SparseConfigError(
            f"{where} = {json_text(value)} must be {_TYPE_NAMES[want]}{allowed}, got {json_type_name(value)}")
    if want is float and not math.isfinite(value):
        raise SparseConfigError(f"{where} = {value!r} is not a finite number; allowed range {rng}")
    if rng is not None and not rng.contains(value):
        raise SparseConfigError(f"{where} = {value!r} is out of range; allowed range {rng}")
    if choices is not None and value not in choices:
        raise SparseConfigError(f"{where} = {value!r} is not allowed; choose one of {list(choices)}")
    return value


# --------------------------------------------------------------------------- modes' configs
# Defaults are the papers' (../shared/DESIGN.md §4); the issue that implements a mode owns
# its knobs and may extend them.

_POS = Range(0, None, lo_open=True)
_UNIT = Range(0.0, 1.0, lo_open=True)


def _host_tier_knobs():
    """Host-tier keys shared by the modes that serve it (``sglang_sparse.host_tier.cache``)."""
    return dict(
        host_tier_gb=knob(0.0, doc="pinned host memory (GiB) keeping radix nodes evicted from the GPU, loaded back "
                          "on a prefix hit instead of recomputed (0 = host tier off)", range=Range(0, 4096)),
        gpu_cache_mb=knob(64.0, doc="host tier: GPU unit cache (MiB) that reloads are gathered through",
                          range=Range(0, 1 << 20, lo_open=True)),
        working_set_window=knob(12, doc="host tier: decode steps whose block selections form a request's working "
                                "set (SparseServe w)", range=Range(1, 256)),
        working_set_admission=knob(True, doc="host tier (host_tier_gb > 0): the scheduler admits a waiting request "
                                   "to the running batch only while the running requests' working sets (units "
                                   "selected in their last working_set_window steps) plus the newcomers' "
                                   "estimates fit the GPU unit cache (gpu_cache_mb); false: stock admission"),
        working_set_slots=knob(64, doc="host tier admission: decoding requests whose working sets are tracked "
                               "(others count their whole context); memory slots x layers x KV heads x "
                               "max blocks per request x 4 B (loopserve: a block is a KV page)", range=Range(1, 4096)),
    )


@dataclass(frozen=True)
class OffConfig(SparseConfig):
    """Dense attention, stock radix cache: no options."""

    mode: ClassVar[str] = "off"


def _runner_knob():
    return knob("auto", doc="compute path: 'auto' = the Triton/FlashInfer kernels on CUDA, the fp32 torch reference "
                "elsewhere; 'kernel' = the kernels on any device (on CPU through Triton's interpreter: the "
                "scheduler needs TRITON_INTERPRET=1; slow, for tests)", choices=("auto", "kernel"))


def uses_kernels(config, device_type: str) -> bool:
    """Whether a mode's ``runner`` knob puts its compute on the kernels on a ``device_type`` server."""
    return device_type == "cuda" or getattr(config, "runner", "auto") == "kernel"


def _stock_graphs_knob():
    return knob(True, doc="decode CUDA graphs: also record SGLang's stock decode graph per batch size, replayed by "
                "batches without a sparse row (false: those batches decode eagerly)")


def _prefill_graphs_knob():
    return knob(True, doc="CUDA: keep SGLang's prefill CUDA graphs (psa: every extend batch, its prefill is stock; "
                "loopserve, lastwindow: extend batches whose rows all end below min_context, a batch with a longer "
                "row runs eagerly). False, or a prefill graph backend other than SGLang's default breakable one: "
                "prefill graphs off for this mode")


@dataclass(frozen=True)
class PsaConfig(SparseConfig):
    """PSA progressive threshold decode (PSA Alg. 1)."""

    mode: ClassVar[str] = "psa"
    epsilon: float = knob(PsaDecodeConfig.epsilon, doc="stop once the estimated kept attention mass >= epsilon", range=_UNIT)
    micro_batch_blocks: int = knob(PsaDecodeConfig.micro_batch_blocks, doc="KV blocks attended per progressive step (a power of two)",
                                   choices=tuple(1 << i for i in range(13)))
    block_size: int = knob(16, doc="tokens per block when --page-size is 1 (else the page is the block)",
                           range=Range(1, 1024))
    sink_pages: int = knob(PsaDecodeConfig.sink_blocks, doc="first pages always attended", range=Range(0, 1024))
    local_pages: int = knob(PsaDecodeConfig.local_blocks, doc="last pages always attended", range=Range(0, 1024))
    min_context: int = knob(32768, doc="contexts shorter than this (tokens) decode densely, unprobed: on real attention "
                            "at 16k-32k tokens (the 32k testbed) the stop test reads ~92 % of the blocks, the kernel "
                            "takes 1.3-1.7x FlashInfer dense's time, and the prefill probe alone cost 8-15 % of stock "
                            "throughput at 16k", range=Range(0, 1 << 24))
    max_blocks: int = knob(PsaDecodeConfig.max_blocks, doc="upper bound on blocks read per (request, KV head)", range=Range(1, 1 << 24))
    min_request_epsilon: float = knob(0.5, doc="floor for a request's own epsilon (custom_params.sparse.epsilon); "
                                      "lower requested values are clamped up to it", range=_UNIT)
    dense_above: float = knob(0.5, doc="adaptive switch: a request whose first probe_steps sparse decode steps read "
                              "more than this fraction of its blocks decodes densely from then on (stock decode, "
                              "stock CUDA graph): on diffuse attention PSA reads most blocks and its ranking costs "
                              "more than it saves; 1.0 = never switch", range=_UNIT)
    probe_steps: int = knob(4, doc="sparse decode steps a long request runs before the dense_above test",
                            range=Range(1, 4096))
    estimator: str = knob(PsaDecodeConfig.estimator, doc="remaining-mass estimate of the stop test: 'calibrated' (cuboid bound "
                          "scaled by the tightness seen on blocks read; reads most blocks on real attention), "
                          "'mean' (q . mean key raised by the largest gap seen: fewer reads, not a bound) or "
                          "'sketch' (an int4 copy of every key ranks the blocks and estimates the unread mass; "
                          "head_dim / 2 + 2 bytes per token and KV head in place of the block min / max / mean)",
                          choices=("calibrated", "mean", "sketch"))
    schedule: str = knob(PsaDecodeConfig.schedule, doc="how the stop point is found: 'progressive' (PSA's stop test "
                         "after every chunk of the ranked blocks, on the true attention mass read so far) or 'select' "
                         "(estimator 'sketch' only: the sketch's predicted top-p blocks, selected in one pass and read "
                         "in one split pass; no sort and no attention waves)", choices=("progressive", "select"))
    calib_slack: float = knob(PsaDecodeConfig.calib_slack, doc="log2 safety margin of the stop test's estimate of the "
                              "unread mass ('calibrated', 'mean' and 'sketch'): higher reads more blocks and keeps "
                              "more mass. On captured testbed attention at 8k, schedule 'select' left 1 of 135 query "
                              "heads below epsilon at 2 (kept 0.90, 42 % of blocks read), none at 4 (58 % read)",
                              range=Range(0.0, 16.0))
    cuda_graph: bool = knob(True, doc="CUDA: replay decode graphs for batches with a sparse row (false: eager)")
    stock_rows: str = knob("auto", doc="the rows of a sparse decode step that are not sparse (below min_context, "
                           "probing, sent dense): 'kernel' attends them with the PSA kernel at epsilon 1 (exact up to "
                           "rounding, but a reply can change with its batch), 'exact' takes them from the stock decode "
                           "run over the batch as well (the same tokens as --sparse off, at the cost of a dense pass "
                           "in every sparse step), 'auto' = 'exact' under --enable-deterministic-inference, else "
                           "'kernel'", choices=("auto", "exact", "kernel"))
    stock_graphs: bool = _stock_graphs_knob()
    prefill_graphs: bool = _prefill_graphs_knob()
    runner: str = _runner_knob()
    host_tier_gb: float = _host_tier_knobs()["host_tier_gb"]
    gpu_cache_mb: float = _host_tier_knobs()["gpu_cache_mb"]
    working_set_window: int = _host_tier_knobs()["working_set_window"]
    working_set_admission: bool = _host_tier_knobs()["working_set_admission"]
    working_set_slots: int = _host_tier_knobs()["working_set_slots"]

    def __post_init__(self):
        super().__post_init__()
        if self.schedule == "select" and self.estimator != "sketch":
            raise SparseConfigError(f"--sparse-config: field 'schedule' of mode 'psa' = \"select\" is not allowed with "
                                    f"estimator {json_text(self.estimator)} (it selects from the key sketch); allowed "
                                    "with \"select\": estimator \"sketch\"")


def _graph_knobs(width: int, max_bs: int = 16):
    """Decode-graph keys shared by loopserve and lastwindow (``sglang_sparse.loopserve.graph``)."""
    return dict(
        graph_list_width=knob(width, doc="decode CUDA graphs (a server without --disable-cuda-graph): the widest "
                              "per-(row, KV head) token list a graph-replayed step takes (steps with wider lists, "
                              "lastwindow's selection step and steps with rows in prefill run eagerly; decode lists "
                              "are split "
                              "into spans as if this wide, graphs on or off; capped at the served context length). "
                              "Static buffers of layers x graph_max_bs x KV heads x this many int32",
                              range=Range(1, 1 << 20)),
        graph_max_bs=knob(max_bs, doc="decode CUDA graphs: largest batch replayed over the sparse path (larger batches "
                          "run eagerly)", range=Range(1, 4096)),
        stock_graphs=_stock_graphs_knob(),
        prefill_graphs=_prefill_graphs_knob(),
        runner=_runner_knob(),
    )


_LOOPSERVE_GRAPH = _graph_knobs(32768, 32)
_LASTWINDOW_GRAPH = _graph_knobs(2048)


@dataclass(frozen=True)
class LoopServeConfig(SparseConfig):
    """LoopServe online prefill lines + progressive decode (LoopServe Alg. 1-3)."""

    mode: ClassVar[str] = "loopserve"
    alpha: float = knob(0.99, doc="fraction of sampled attention mass the lines must cover (0.955 lost facts that the sampled rows do not see)", range=_UNIT)
    n_d: int = knob(16, doc="decode re-selection interval (tokens)", range=Range(1, 4096))
    budget: int = knob(1024, doc="top-B tokens kept per KV head in decode", range=Range(1, 1 << 24))
    sampled_rows: int = knob(64, doc="query rows sampled for line estimation", range=Range(1, 8192))
    min_context: int = knob(65536, doc="segments over contexts shorter than this run dense (prefill and decode). "
                            "End to end on the 32k testbed (SmolLM2, YaRN) no length engaged pays: at 32k the "
                            "engaged mode ran at 0.36-0.67x stock throughput, so the default engages only past "
                            "that context; lower it for models whose dense attention costs more per token "
                            "(docs/loopserve.md)", range=Range(0, 1 << 24))
    sink_tokens: int = knob(4, doc="first key positions always attended (vertical lines)", range=Range(0, 1 << 20))
    local_window: int = knob(64, doc="slash offsets 0..local_window-1 always attended", range=Range(1, 1 << 20))
    min_request_alpha: float = knob(0.5, doc="floor for a request's own alpha (custom_params.sparse.alpha); "
                                    "lower requested values are clamped up to it", range=_UNIT)
    max_request_budget: int = knob(1 << 16, doc="ceiling for a request's own budget (custom_params.sparse.budget)",
                                   range=Range(1, 1 << 24))
    line_store_mb: int = knob(256, doc="memory bound of the per-turn line sets kept on radix nodes (MiB)",
                              range=Range(0, 1 << 20))
    prefill: str = knob("dense", doc="attention of an engaged prefill segment: dense = the stock attention computes it "
                        "and LoopServe only estimates and selects the segment's lines (for the decode lists and the "
                        "turns after), lines = Alg. 2's sparse attention over the lines. End to end at 32k on the "
                        "testbed the lines prefill made TTFT 2.4-3.3x stock's against 1.8x with dense (its kernel ran "
                        "at 0.15x of FlashInfer's dense prefill), so dense is the default", choices=("dense", "lines"))
    line_chunks: str = knob("auto", doc="which chunks of an engaged prompt estimate and select lines for the decode "
                            "lists and the turns after. auto = last with prefill dense, all with prefill lines; last = "
                            "the prompt's last chunk only (its sampled rows see the whole prompt; earlier chunks cost "
                            "nothing over stock): on the 32k testbed as close to dense as all, with TTFT 1.35x stock's "
                            "against 1.67x; all = every prefill chunk; none = no lines (decode lists = sink, local "
                            "window, generated tokens and the re-selected top-B: fastest, but it lost answers to "
                            "questions at the start of a turn). prefill lines needs auto or all",
                            choices=("auto", "all", "last", "none"))
    initial_topb: bool = knob(True, doc="also select the top-B tokens at every decode step before generated token 16, "
                              "from the last n_d queries (false: Alg. 3 exactly, stored lines only until token 16)")
    select_graph_rows: int = knob(8, doc="decode CUDA graphs: a step where at most this many rows re-select their "
                                  "top-B (initial_topb, every n_d) replays a re-selecting graph recorded per batch "
                                  "size beside the steady one (it scores this many rows over graph_list_width keys "
                                  "whatever the batch); more selecting rows, or 0, decode eagerly. Needs stock_graphs",
                                  range=Range(0, 4096))
    # lines of both kinds can reach the context length (at alpha 0.99 a 32k context's decode lists average
    # ~11k tokens per KV head): as wide as the context, up to 32k, unlike lastwindow's budget-bound lists
    graph_list_width: int = _LOOPSERVE_GRAPH["graph_list_width"]
    graph_max_bs: int = _LOOPSERVE_GRAPH["graph_max_bs"]
    stock_graphs: bool = _LOOPSERVE_GRAPH["stock_graphs"]
    prefill_graphs: bool = _LOOPSERVE_GRAPH["prefill_graphs"]
    runner: str = _LOOPSERVE_GRAPH["runner"]
    host_tier_gb: float = _host_tier_knobs()["host_tier_gb"]
    gpu_cache_mb: float = _host_tier_knobs()["gpu_cache_mb"]
    working_set_window: int = _host_tier_knobs()["working_set_window"]
    working_set_admission: bool = _host_tier_knobs()["working_set_admission"]
    working_set_slots: int = _host_tier_knobs()["working_set_slots"]

    def __post_init__(self):
        super().__post_init__()
        if self.prefill == "lines" and self.line_chunks not in ("auto", "all"):
            raise SparseConfigError(f"--sparse-config: field 'line_chunks' of mode 'loopserve' = "
                                    f"{json_text(self.line_chunks)} is not allowed with prefill \"lines\" (its sparse "
                                    "attention needs every chunk's lines); allowed: \"auto\", \"all\"")


@dataclass(frozen=True)
class LastWindowConfig(SparseConfig):
    """Last-window baseline (SnapKV-like): dense prefill, then decode attends a fixed top-``budget``
    per KV head chosen once from the attention of the prompt's last ``window`` queries, plus the
    sink, that window and the generated tokens (LoopServe's question-position baseline)."""

    mode: ClassVar[str] = "lastwindow"
    budget: int = knob(1024, doc="tokens kept per KV head for decode (chosen once, after prefill)",
                       range=Range(1, 1 << 24))
    window: int = knob(32, doc="last prompt queries whose attention chooses the budget", range=Range(1, 4096))
    min_context: int = knob(65536, doc="prompts shorter than this decode densely. On the 32k testbed (SmolLM2, YaRN) "
                            "the baseline engaged from 4096 tokens kept 0.27-0.58 of dense accuracy and served at "
                            "0.16-0.92x stock throughput, so by default it engages only past that context; set it "
                            "(e.g. 4096) to measure the baseline (docs/lastwindow.md)", range=Range(0, 1 << 24))
    sink_tokens: int = knob(4, doc="first key positions always attended", range=Range(0, 1 << 20))
    pool_kernel: int = knob(7, doc="SnapKV pooling: the window's attention is averaged over this many neighbouring "
                            "positions before the top-budget choice (odd; 1 = none)", range=Range(1, 63))
    graph_list_width: int = _LASTWINDOW_GRAPH["graph_list_width"]
    graph_max_bs: int = _LASTWINDOW_GRAPH["graph_max_bs"]
    stock_graphs: bool = _LASTWINDOW_GRAPH["stock_graphs"]
    prefill_graphs: bool = _LASTWINDOW_GRAPH["prefill_graphs"]
    runner: str = _LASTWINDOW_GRAPH["runner"]

    def __post_init__(self):
        super().__post_init__()
        if self.pool_kernel % 2 == 0:
            raise SparseConfigError(f"--sparse-config: field 'pool_kernel' of mode 'lastwindow' = {self.pool_kernel} is "
                                    "not allowed; allowed: an odd integer in [1, 63]")


@dataclass(frozen=True)
class SamKVConfig(SparseConfig):
    """SamKV per-document reuse with sparsification and selective recompute (SamKV §3)."""

    mode: ClassVar[str] = "samkv"
    block_size: int = knob(32, doc="tokens per scoring block", range=Range(1, 4096))
    initial_blocks: int = knob(1, doc="leading blocks of each document always kept", range=Range(0, 64))
    local_blocks: int = knob(2, doc="trailing blocks of each document always kept", range=Range(0, 64))
    stable_layers: int = knob(4, doc="last layers averaged for block scores (Eq. 3)", range=Range(1, 1024))
    fuse: str = knob("fusion", doc="how recomputed KV replaces reused KV (Eq. 4)", choices=("overwrite", "fusion"))
    variant: str = knob("samkv", doc="default pipeline of a documents request (per request: extra_body samkv.variant): "
                        "samkv = reuse + SamKV block selection + selective recompute, reuse = plain reuse of every block, "
                        "recompute = dense "
                        "prefill of the concatenation, cacheblend = reuse of every block + selective recompute",
                        choices=("samkv", "reuse", "recompute", "cacheblend"))
    min_document_tokens: int = knob(4096, doc="a documents request that names no variant and whose documents "
                                    "hold fewer tokens in all is served by recompute (the stock inline prompt, "
                                    "dense; reported as variant_reason): short documents save little prefill, and "
                                    "their kept budget holds a block or two of their middle, which lost answers; "
                                    "0 = never", range=Range(0, 1 << 24))
    min_middle_blocks: int = knob(1, doc="a documents request that names no variant and whose kept budget "
                                  "(max_kept_ratio less the always-kept blocks) holds fewer middle blocks than "
                                  "this many per document that has a middle is served by recompute (many short "
                                  "documents: every fact between a document's first and last blocks would be "
                                  "dropped); 0 = never", range=Range(0, 1 << 16))
    selection: str = knob("mass", doc="how middle blocks are chosen: mass = the question's attention mass per block "
                          "(softmax over all documents' tokens, layers mass_layers) and the best blocks of all "
                          "documents kept; anchor_top_p = the paper's Eq. 2-3 ratio per document, mean-key block "
                          "scores of the last stable_layers layers, cross-document normalisation",
                          choices=("mass", "anchor_top_p"))
    mass_layer_from: float = knob(0.4, doc="selection=mass: first layer whose question attention is summed, as a "
                                  "fraction of the layers (layer floor(from * L))", range=Range(0.0, 1.0, hi_open=True))
    mass_layer_to: float = knob(0.7, doc="selection=mass: end of those layers, as a fraction (layers up to "
                                "ceil(to * L), exclusive); must be > mass_layer_from", range=Range(0.0, 1.0, lo_open=True))
    mass_spread: int = knob(8, doc="selection=mass: each token's question mass is shared over the tokens within "
                            "this many of it (same document) before the per-block sums, so the block after a heavy "
                            "token at a block's end scores too (facts that cross a block edge); 0 = plain block "
                            "sums", range=Range(0, 4096))
    personalize: bool = knob(True, doc="add the other documents' local queries to the question's (Eq. 1)")
    local_query_tokens: int = knob(16, doc="last tokens of each document whose queries form its local query "
                                   "(side forward rows; SGLang keeps no Q cache)", range=Range(1, 1 << 20))
    max_kept_ratio: float = knob(0.2, doc="cap of the kept document tokens (initial + local + selected middle "
                                 "blocks) as a fraction of all document tokens; the middle-block budget is "
                                 "min(SamKV's total_blocks // D - always kept, (floor(max_kept_ratio * tokens) - "
                                 "always-kept tokens) // block_size); 1 = SamKV's rule alone", range=Range(0.0, 1.0))
    anchor_share: float = knob(1.0, doc="most of the max_kept_ratio token budget the always-kept (initial + local) "
                               "blocks may take; beyond it local blocks are trimmed, oldest first, down to one "
                               "(short documents); 1 = trim only when they exceed the whole budget",
                               range=Range(0.0, 1.0))
    recompute_ratio: float = knob(0.15, doc="fraction of each document's kept tokens recomputed over the composite "
                                  "(samkv, cacheblend; 0 = none)", range=Range(0.0, 1.0))
    side_graphs: str = knob("auto", doc="SamKV's side forwards (selection rows, recompute rows): auto = padded to "
                            "buckets and replayed as CUDA graphs on CUDA (eager elsewhere), pad = the padded path run "
                            "eagerly, off = eager, unpadded", choices=("auto", "pad", "off"))
    side_attention: str = knob("model", doc="the side forwards' attention: model = q/k/v in the model's dtype on "
                               "SDPA's memory-efficient kernel (fp32 softmax and accumulation inside, as the serving "
                               "kernels; CUDA only, fp32 on the CPU, whose bf16 SDPA rounds the softmax), or fp32 = q/k/v "
                               "in fp32 (H100, 8B shape, 8 x 1.9k tokens: recompute phase 70 ms vs 23 ms with model)",
                               choices=("fp32", "model"))
    side_graph_max_rows: int = knob(512, doc="side_graphs: most rows of a padded / graphed side forward (more run "
                                    "eagerly)", range=Range(1, 1 << 16))
    side_graph_max_context: int = knob(4096, doc="side_graphs: most context tokens of a padded / graphed side "
                                       "forward (more run eagerly); its K/V buffers take 2 * layers * this * "
                                       "kv_heads * head_dim elements", range=Range(1, 1 << 20))
    overlap_schedule: bool = knob(True, doc="on CUDA, keep SGLang's overlap scheduler (false: the server runs with "
                                  "--disable-overlap-schedule). On by default: plain requests are scheduled as stock "
                                  "SGLang schedules them (its throughput, and the same answers as off); the documents' "
                                  "assembly synchronises the device before it touches the KV pool. Off trades plain "
                                  "throughput (0.64-0.92x stock on the 32k testbed) for a server that kept serving "
                                  "where every server running the overlap scheduler, stock off included, stalled: "
                                  "the long preset at concurrency 16 beside other servers on the same GPU "
                                  "(bench/results/samkv_overlap.md)")
    prefill_graphs: bool = knob(True, doc="CUDA: keep SGLang's prefill CUDA graphs (its default breakable backend: "
                                "attention runs eagerly between captured segments, so a question prefilled over an "
                                "assembled composite is an ordinary prefix hit). False, or a prefill graph backend other "
                                "than the breakable one: prefill graphs off for this mode")
    max_documents: int = knob(64, doc="most documents in one request", range=Range(1, 4096))
    max_document_chars: int = knob(4_000_000, doc="most characters of all documents of one request",
                                   range=Range(1, 1 << 40))

    def __post_init__(self):
        super().__post_init__()
        if self.mass_layer_to <= self.mass_layer_from:
            raise SparseConfigError(f"--sparse-config: field 'mass_layer_to' of mode 'samkv' = {self.mass_layer_to} is out of "
                             f"range; allowed: greater than mass_layer_from = {self.mass_layer_from}, at most 1")

    def mass_layer_range(self, num_layers: int) -> range:
        """The layers ``selection="mass"`` sums: ``floor(from * L) .. ceil(to * L)`` (at least one)."""
        lo = min(num_layers - 1, math.floor(self.mass_layer_from * num_layers))
        return range(lo, max(lo + 1, min(num_layers, math.ceil(self.mass_layer_to * num_layers))))
