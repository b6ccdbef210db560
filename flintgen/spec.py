"""The model spec: everything about a model that flintgen's kernels depend on.

A ``Spec`` is frozen, validated on construction, hashable, and has one
canonical JSON form (sorted keys, per-field normalized values) whose sha256 is
its ``spec_hash``: the same in every process and independent of field order in
the file it came from.

Fields added after the first spec format (``rotary_dim`` and the
``sliding_rope_*`` fields) are left out of the canonical form while at their
defaults, so specs that do not use them keep their earlier hashes.

Runtime values (``rms_eps``, ``softmax_scale``, ``sliding_window`` length,
``rope_theta``) are recorded in the spec for convenience but are passed to the
kernels as arguments, so changing them never recompiles anything; only what a
``KernelDef`` renders into its template reaches a binary. Likewise
``attn_logit_softcap`` says only that attention logits are soft-capped (a code
path); the cap itself (Gemma 2's ``attn_logit_softcapping``, e.g. 50.0) is an
argument of decode attention.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
SUPPORTED_PAGE_SIZES = (16, 32, 64)
SUPPORTED_KV_DTYPES = ("bf16", "fp8_e4m3")   # fp8: e4m3 with one fp32 scale per layer for K and V
SUPPORTED_KV_LAYOUTS = ("HND",)
SUPPORTED_WEIGHT_FORMATS = ("bf16", "nvfp4")
SUPPORTED_ROPE_STYLES = ("neox", "interleaved", "none")
SUPPORTED_ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")
ROPE_LIST_PARAMS = ("short_factor", "long_factor")  # longrope's per-frequency factors: rotary_dim / 2 numbers
LAYER_TYPES = ("sliding", "full")
MAX_TOKENS_LIMIT = 64  # fused-QKV GEMV: its largest token tile (flintgen.configs.qkv_config.TOKEN_TILES)


def _fail(field_name: str, value: Any, supported: str, fix: str) -> ValueError:
    return ValueError(
        f"spec field '{field_name}' = {value!r} is not supported: {supported}. {fix}"
    )


def _check_int(name: str, value: Any, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"spec field '{name}' must be an int, got {type(value).__name__} {value!r}: "
            f"write it as a whole number without quotes, e.g. {name} = 16"
        )
    if value < lo:
        raise _fail(name, value, f"must be >= {lo}", f"Set '{name}' to a positive value.")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"spec field '{name}' must be a bool, got {type(value).__name__} {value!r}: "
            f"write {name} = true or {name} = false"
        )


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise _fail(name, value, f"supported values are {list(choices)}", f"Use one of {list(choices)}.")


def _check_float(name: str, value: Any, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"spec field '{name}' must be a number, got {type(value).__name__} {value!r}: "
            f"write it without quotes, e.g. {name} = 10000.0"
        )
    if not math.isfinite(value) or (positive and value <= 0):
        raise _fail(name, value, "must be a finite number > 0", f"Set '{name}' to a positive value.")


def _check_kernel_limits(spec: "Spec") -> None:
    """Each integer field within the union of the ranges flintgen's kernels
    declare (``KernelDef.limits``); a kernel outside its own range refuses the
    spec when it is built."""
    from flintgen.kernels import KERNELS

    ranges: dict[str, list[tuple[str, int, int]]] = {}
    for kdef in KERNELS.values():
        for f, (lo, hi) in kdef.limits.items():
            ranges.setdefault(f, []).append((kdef.name, lo, hi))
    for f, per in sorted(ranges.items()):
        lo, hi = min(r[1] for r in per), max(r[2] for r in per)
        value = getattr(spec, f)
        if not lo <= value <= hi:
            each = ", ".join(f"{k} {a}..{b}" for k, a, b in per)
            raise _fail(f, value, f"flintgen's kernels support {lo}..{hi} ({each})",
                        f"Use a {f} in {lo}..{hi}.")


def _rope_params(params: Any, name: str = "rope_scaling_params") -> tuple[tuple[str, Any], ...]:
    """``rope_scaling_params`` as (name, value) pairs sorted by name, from a mapping or pairs.
    Values are floats, except longrope's ``short_factor`` / ``long_factor``: tuples of floats."""
    if isinstance(params, Mapping):
        params = list(params.items())
    try:
        items = [(k, v) for k, v in params]
    except (TypeError, ValueError):
        raise TypeError(f"spec field '{name}' must be a table of name = number, got "
                        f"{type(params).__name__} {params!r}: write e.g. {name} = "
                        "{ factor = 8.0 }") from None
    out: dict[str, Any] = {}
    for k, v in items:
        if not isinstance(k, str):
            raise _fail(f"{name}", k, "parameter names are strings", "Name each parameter, e.g. factor = 8.0.")
        if k in out:
            raise _fail(f"{name}.{k}", v, "each parameter once", f"Remove the repeated '{k}'.")
        if k in ROPE_LIST_PARAMS:
            if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, (list, tuple)) or not v or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
                    for x in v):
                raise _fail(f"{name}.{k}", v, "a non-empty list of finite numbers > 0 (one per rotary "
                            "frequency: rotary_dim / 2 of them)",
                            f"Give {k} as a list of numbers, e.g. {k} = [1.0, 1.0, ...] from config.json.")
            out[k] = tuple(float(x) for x in v)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _fail(f"{name}.{k}", v, "a finite number",
                        "Give each rope scaling parameter as a number, e.g. factor = 8.0.")
        out[k] = float(v)
    return tuple(sorted(out.items(), key=lambda kv: kv[0]))


def _check_rope_scaling_params(name: str, scaling: str, params: tuple, rope_dim: int) -> None:
    """List-valued parameters only for longrope, each rope_dim / 2 long."""
    for k, v in params:
        if isinstance(v, tuple):
            if scaling != "longrope":
                raise _fail(f"{name}.{k}", list(v), f"list-valued parameters are longrope's {list(ROPE_LIST_PARAMS)}",
                            f"Remove {k}, or set the scaling to 'longrope'.")
            if len(v) != rope_dim // 2:
                raise _fail(f"{name}.{k}", f"<{len(v)} numbers>", f"longrope needs rotary_dim / 2 = {rope_dim // 2} "
                            f"numbers (rotary_dim {rope_dim})",
                            f"Give {rope_dim // 2} factors, or check rotary_dim / head_dim against config.json.")


# The fields added after the first released spec format: left out of the canonical form
# (to_dict / canonical_json / spec_hash) while at their default, so a spec that does not
# use them keeps the hash it had before they existed.
_OMITTED_AT_DEFAULT = {"rotary_dim": None, "sliding_rope_theta": None, "sliding_rope_scaling": "none",
                       "sliding_rope_scaling_params": {}, "attn_logit_softcap": False, "norm_weight_offset": 0}


@dataclass(frozen=True)
class Spec:
    """A model's attention-path shape, per the whole model (not per rank).

    Per-rank head counts (``q_heads_per_rank``, ``kv_heads_per_rank``) are
    derived from ``tp_size``: q heads are split evenly; kv heads are split when
    ``num_kv_heads >= tp_size`` and replicated (one per rank) otherwise.

    ``attn_logit_softcap``: decode attention soft-caps its logits,
    ``cap * tanh(s * scale / cap)`` before the softmax (Gemma 2); the cap is
    the op's ``softcap`` argument. Sinks are not capped.

    ``norm_weight_offset``: 0, or 1 for checkpoints that store RMSNorm
    weights as ``w`` and scale by ``(1 + w)`` (Gemma): the kernels add the
    offset in fp32 to the input-layernorm and q / k norm weights, which are
    passed as stored.
    """

    name: str = "custom"
    hidden_size: int = 2048
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    page_size: int = 16
    kv_cache_dtype: str = "bf16"
    kv_layout: str = "HND"
    weight_format: str = "nvfp4"
    qkv_bias: bool = False
    sinks: bool = True
    attn_logit_softcap: bool = False
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] = ("sliding", "full")
    qk_norm: bool = True
    rope_style: str = "neox"
    rope_theta: float = 150000.0
    rope_scaling: str = "none"
    rope_scaling_params: tuple[tuple[str, Any], ...] = ()
    # RoPE rotates the first rotary_dim dims of each head (None: all head_dim); the rest pass through.
    rotary_dim: int | None = None
    # Sliding layers' own (theta, scaling) (Gemma 3's local RoPE); None theta: the main ones above.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: str = "none"
    sliding_rope_scaling_params: tuple[tuple[str, Any], ...] = ()
    rms_eps: float = 1e-6
    norm_weight_offset: int = 0
    softmax_scale: float | None = None
    max_tokens: int = 8   # tokens per fused QKV call (1..64: one QKV binary per token tile of 8 / 16 / 32 / 64 up to it)
    tp_size: int = 1
    max_batch: int = 256

    def __post_init__(self) -> None:
        # Normalize containers so equal specs hash equally.
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, (list, tuple)):
            raise TypeError(f"spec field 'layer_types' must be a list of 'sliding'/'full', got "
                            f"{type(self.layer_types).__name__} {self.layer_types!r}: write e.g. "
                            "layer_types = [\"sliding\", \"full\"]")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "rope_scaling_params", _rope_params(self.rope_scaling_params))
        if isinstance(self.rope_theta, int) and not isinstance(self.rope_theta, bool):
            object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "sliding_rope_scaling_params",
                           _rope_params(self.sliding_rope_scaling_params, "sliding_rope_scaling_params"))
        if isinstance(self.sliding_rope_theta, int) and not isinstance(self.sliding_rope_theta, bool):
            object.__setattr__(self, "sliding_rope_theta", float(self.sliding_rope_theta))
        # One spelling per meaning (equal specs hash equally): rotary_dim == head_dim is None, and
        # sliding RoPE equal to the main one is unset.
        if self.rotary_dim == self.head_dim and type(self.rotary_dim) is int:
            object.__setattr__(self, "rotary_dim", None)
        if (self.sliding_rope_theta, self.sliding_rope_scaling, self.sliding_rope_scaling_params) == (
                self.rope_theta, self.rope_scaling, self.rope_scaling_params):
            object.__setattr__(self, "sliding_rope_theta", None)
            object.__setattr__(self, "sliding_rope_scaling", "none")
            object.__setattr__(self, "sliding_rope_scaling_params", ())
        self._validate()

    # ------------------------------------------------------------- validation
    def _validate(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"spec field 'name' must be a non-empty string, got {self.name!r}: give the "
                            "model a name, e.g. name = \"my-model\"")
        for f in ("hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "page_size",
                  "max_tokens", "tp_size", "max_batch"):
            _check_int(f, getattr(self, f))
        for f in ("qkv_bias", "sinks", "attn_logit_softcap", "qk_norm"):
            _check_bool(f, getattr(self, f))
        _check_choice("head_dim", self.head_dim, SUPPORTED_HEAD_DIMS)
        _check_choice("page_size", self.page_size, SUPPORTED_PAGE_SIZES)
        if self.kv_cache_dtype in ("fp8_e5m2", "fp8", "int8"):
            raise _fail("kv_cache_dtype", self.kv_cache_dtype, f"supported values are {list(SUPPORTED_KV_DTYPES)} "
                        "(e5m2 and int8 caches are not implemented; 'fp8' is ambiguous)",
                        "Use kv_cache_dtype = 'fp8_e4m3' (vLLM's --kv-cache-dtype fp8 is e4m3 on Hopper) or 'bf16'.")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, SUPPORTED_KV_DTYPES)
        _check_choice("kv_layout", self.kv_layout, SUPPORTED_KV_LAYOUTS)
        _check_choice("weight_format", self.weight_format, SUPPORTED_WEIGHT_FORMATS)
        _check_choice("rope_style", self.rope_style, SUPPORTED_ROPE_STYLES)
        _check_choice("rope_scaling", self.rope_scaling, SUPPORTED_ROPE_SCALINGS)
        _check_float("rope_theta", self.rope_theta)
        _check_float("rms_eps", self.rms_eps)
        if type(self.norm_weight_offset) is not int or self.norm_weight_offset not in (0, 1):
            raise _fail("norm_weight_offset", self.norm_weight_offset,
                        "0 (weights scale as stored) or 1 (Gemma's (1 + w), added in fp32)",
                        "Set norm_weight_offset = 1 for Gemma checkpoints, else leave it 0.")
        if self.softmax_scale is not None:
            _check_float("softmax_scale", self.softmax_scale)
        if self.hidden_size % 16:
            raise _fail("hidden_size", self.hidden_size, "must be a multiple of 16 "
                        "(16-byte bf16 vectors and 16-value NVFP4 scale blocks)",
                        "Pad the hidden size to a multiple of 16.")
        if self.num_q_heads % self.num_kv_heads:
            raise _fail("num_q_heads", self.num_q_heads,
                        f"must be a multiple of num_kv_heads = {self.num_kv_heads} (GQA)",
                        "Check the head counts against the model config.")
        _check_kernel_limits(self)
        if self.max_batch > 4096:
            raise _fail("max_batch", self.max_batch, "1..4096", "Lower max_batch.")
        if self.num_q_heads % self.tp_size:
            raise _fail("tp_size", self.tp_size, f"must divide num_q_heads = {self.num_q_heads}",
                        "Pick a tensor-parallel size that divides the q-head count.")
        kv, tp = self.num_kv_heads, self.tp_size
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise _fail("tp_size", tp, f"must divide num_kv_heads = {kv} or be a multiple of it "
                        "(kv heads are then replicated, one per rank)",
                        "Pick a tensor-parallel size compatible with the kv-head count.")
        if not self.layer_types:
            raise _fail("layer_types", list(self.layer_types), "at least one layer", "List each layer's type.")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise _fail(f"layer_types[{i}]", t, f"supported values are {list(LAYER_TYPES)}",
                            f"Use one of {list(LAYER_TYPES)}.")
        if self.has_sliding:
            if self.sliding_window is None:
                raise _fail("sliding_window", None, "a window length is needed when layer_types "
                            "has 'sliding' layers", "Set sliding_window, or make every layer 'full'.")
            _check_int("sliding_window", self.sliding_window)
        elif self.sliding_window is not None:
            raise _fail("sliding_window", self.sliding_window, "no layer in layer_types is 'sliding'",
                        "Set sliding_window to None, or mark the sliding layers in layer_types.")
        if self.rope_style == "none" and self.rope_scaling != "none":
            raise _fail("rope_scaling", self.rope_scaling, "rope_style is 'none'",
                        "Set rope_scaling to 'none' or choose a rope_style.")
        self._validate_rope_variants()

    def _validate_rope_variants(self) -> None:
        """rotary_dim and the sliding layers' RoPE (see the field comments)."""
        if self.rotary_dim is not None:
            _check_int("rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
                raise _fail("rotary_dim", self.rotary_dim, f"an even number in 2..head_dim = {self.head_dim} "
                            "(RoPE rotates pairs of the first rotary_dim dims of each head)",
                            "Set rotary_dim to int(head_dim * partial_rotary_factor) from config.json, or "
                            "remove it to rotate the whole head.")
            if self.rope_style == "none":
                raise _fail("rotary_dim", self.rotary_dim, "rope_style is 'none'",
                            "Remove rotary_dim or choose a rope_style.")
        _check_rope_scaling_params("rope_scaling_params", self.rope_scaling, self.rope_scaling_params,
                                   self.rope_dim)
        _check_choice("sliding_rope_scaling", self.sliding_rope_scaling, SUPPORTED_ROPE_SCALINGS)
        if self.sliding_rope_theta is None:
            if self.sliding_rope_scaling != "none" or self.sliding_rope_scaling_params:
                raise _fail("sliding_rope_scaling", self.sliding_rope_scaling,
                            "sliding_rope_scaling(_params) need sliding_rope_theta (unset: sliding layers use "
                            "rope_theta / rope_scaling)", "Set sliding_rope_theta too, or remove them.")
            return
        _check_float("sliding_rope_theta", self.sliding_rope_theta)
        if self.rope_style == "none":
            raise _fail("sliding_rope_theta", self.sliding_rope_theta, "rope_style is 'none'",
                        "Remove the sliding_rope_* fields or choose a rope_style.")
        if not self.has_sliding:
            raise _fail("sliding_rope_theta", self.sliding_rope_theta, "no layer in layer_types is 'sliding'",
                        "Remove the sliding_rope_* fields, or mark the sliding layers in layer_types.")
        _check_rope_scaling_params("sliding_rope_scaling_params", self.sliding_rope_scaling,
                                   self.sliding_rope_scaling_params, self.rope_dim)

    # ------------------------------------------------------------- derived
    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (rotary_dim, or head_dim when unset)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def rope_for(self, layer_type: str = "full") -> tuple[float, str, tuple[tuple[str, Any], ...]]:
        """(theta, scaling, scaling params) of the RoPE of 'full' or 'sliding' layers."""
        _check_choice("layer_type", layer_type, LAYER_TYPES)
        if layer_type == "sliding" and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling, self.sliding_rope_scaling_params
        return self.rope_theta, self.rope_scaling, self.rope_scaling_params

    @property
    def gqa(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_heads_per_rank(self) -> int:
        return self.num_q_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def has_sliding(self) -> bool:
        return "sliding" in self.layer_types

    @property
    def has_full(self) -> bool:
        return "full" in self.layer_types

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def scale(self) -> float:
        """Softmax scale passed to decode attention (1/sqrt(head_dim) by default)."""
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    @property
    def qkv_out_features(self) -> int:
        """Rows of the per-rank fused QKV weight."""
        return (self.q_heads_per_rank + 2 * self.kv_heads_per_rank) * self.head_dim

    # ------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        for f in ("rope_scaling_params", "sliding_rope_scaling_params"):
            d[f] = {k: list(v) if isinstance(v, tuple) else v for k, v in getattr(self, f)}
        for f, default in _OMITTED_AT_DEFAULT.items():
            if d[f] == default:
                del d[f]
        return d

    def canonical_json(self) -> str:
        """The one serialization: sorted keys, no whitespace."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "Spec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Spec":
        """Build from a mapping; ``preset`` names a base spec the other keys override."""
        data = dict(data)
        base: dict[str, Any] = {}
        if "preset" in data:
            from flintgen.presets import get_preset

            base = get_preset(data.pop("preset")).to_dict()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown spec field(s) {unknown}; known fields are {sorted(known)} (plus 'preset'). "
                "Fix the spelling or remove them."
            )
        base.update(data)
        return cls(**base)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Spec":
        """Load a ``.toml`` or ``.json`` spec file. Every error names the file."""
        path = os.fspath(path)
        if not path.endswith((".toml", ".json")):
            raise ValueError(
                f"spec file {path!r} has an unsupported extension: supported are .toml and .json. "
                "Rename the file or convert it."
            )
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read spec file {path!r}: {e.strerror}. Check the path and its "
                             "permissions.") from None
        try:
            text = raw.decode("utf-8")
            data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
        except UnicodeDecodeError:
            raise ValueError(f"spec file {path!r} is not UTF-8 text: save it as UTF-8 TOML/JSON") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            kind = "TOML" if path.endswith(".toml") else "JSON"
            raise ValueError(f"spec file {path!r} is not valid {kind}: {e}. Fix the syntax.") from None
        if not isinstance(data, dict):
            raise ValueError(f"spec file {path!r} must hold a table/object of fields, got "
                             f"{type(data).__name__}: write e.g. preset = \"flint\" plus the fields to change")
        if not data:
            raise ValueError(f"spec file {path!r} is empty: name a base with preset = \"flint\" (or another "
                             "preset) and the fields to change, or give every field")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise type(e)(f"spec file {path!r}: {e}") from None


def as_spec(spec: "Spec | str") -> Spec:
    """Accept a Spec or a preset name."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        from flintgen.presets import get_preset

        return get_preset(spec)
    raise TypeError(f"expected a flintgen.Spec or a preset name, got {type(spec).__name__}")
