"""Map a Hugging Face ``config.json`` to a flintgen ``Spec``.

Model types: ``MODEL_TYPES`` (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
qwen3_moe, gemma2, gemma3_text, phi3, glm4, glm4_moe, gpt_oss) and gemma3 (its
``text_config``); anything else, MLA models included, is refused by name.

Read from config.json: num_attention_heads, num_key_value_heads (default: MHA),
head_dim (or hidden_size // num_attention_heads), hidden_size, rms_norm_eps,
the q/k/v bias key of the type (attention_bias, qkv_bias; qwen2 always has
one), sliding_window with layer_types or the type's rule
(``ModelType.layers``: use_sliding_window, max_window_layers,
sliding_window_pattern; a window of at least max_position_embeddings is full
attention), attn_logit_softcapping (non-null: the spec's
``attn_logit_softcap``; the cap itself is decode attention's ``softcap``
argument; final_logit_softcapping is the LM head's, not attention's),
query_pre_attn_scalar (Gemma: the softmax scale is its ** -0.5), and the RoPE
(``rope_fields_from_hf_config``): rope_theta, partial_rotary_factor
and rope_scaling (default, linear, llama3, yarn, longrope), in the older keys
(rope_scaling / rope_theta / partial_rotary_factor, Gemma 3's
rope_local_base_freq for its sliding layers) or the transformers-5
``rope_parameters``, flat or keyed by layer type ({"full_attention": {...},
"sliding_attention": {...}}). From the model type (config.json does not say):
attention sinks, per-head q/k RMSNorm, Gemma's (1 + w) norm weights
(``norm_weight_offset``), per ``MODEL_TYPES``; the RoPE pairing and default
partial rotary factor per ``ROPE_STYLES`` / ``PARTIAL_ROTARY_DEFAULTS``.

Not in config.json, so given here (defaults): page_size 16, kv_layout HND,
kv_cache_dtype bf16 (or "fp8_e4m3": the serving engine's choice, vLLM's
--kv-cache-dtype fp8; the k_scale / v_scale come from the checkpoint's
weights, not config.json), weight_format bf16, max_batch 256, max_tokens 8,
tp_size 1.
With tp_size above the kv-head count, kv heads are replicated (one per rank);
tp_size must then be a multiple of the kv-head count.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from flintgen.spec import Spec

@dataclass(frozen=True)
class ModelType:
    """What a model type's modeling code fixes and its config.json does not
    say (transformers 5's configuration_* / modeling_* of the type).

    ``qk_norm`` / ``bias``: a bool the code fixes, or the config key that
    switches it (read with ``*_default`` when config.json lacks the key).
    ``layers``: how layer kinds follow when config.json has no ``layer_types``:
    "none" (no sliding attention), "all" (every layer slides when
    ``sliding_window`` is set), "all_if_used" (... and ``use_sliding_window``),
    "alternate" (layers 0, 2, .. slide), "pattern" (every
    ``sliding_window_pattern``-th layer is full, default 6), "from_max"
    (layers >= ``max_window_layers`` slide, with ``use_sliding_window``),
    "alternate_below_max" (even layers < ``max_window_layers``, with
    ``use_sliding_window``). ``scale_key``: the config key whose value s sets
    the softmax scale s ** -0.5 (default ``scale_default``). ``defaults``:
    the config class's values of keys a config.json may leave out (Gemma 3's
    multimodal checkpoints list only what differs in their text_config).
    """

    sinks: bool = False
    qk_norm: bool | str = False
    qk_norm_default: bool = False
    bias: bool | str = "attention_bias"
    bias_default: bool = False
    norm_weight_offset: int = 0
    scale_key: str | None = None
    scale_default: float | None = None
    layers: str = "all"
    defaults: tuple[tuple[str, Any], ...] = ()


MODEL_TYPES = {
    "llama": ModelType(layers="none"),
    "mistral": ModelType(bias=False),
    "mixtral": ModelType(bias=False),
    "qwen2": ModelType(bias=True, layers="from_max"),                   # q/k/v bias always
    "qwen2_moe": ModelType(bias="qkv_bias", bias_default=True, layers="alternate_below_max"),
    "qwen3": ModelType(qk_norm=True, layers="from_max"),
    "qwen3_moe": ModelType(qk_norm=True, layers="all_if_used"),
    "gemma2": ModelType(norm_weight_offset=1, scale_key="query_pre_attn_scalar", scale_default=256,
                        layers="alternate"),
    "gemma3_text": ModelType(qk_norm=True, norm_weight_offset=1, scale_key="query_pre_attn_scalar",
                             scale_default=256, layers="pattern", defaults=(
                                 ("hidden_size", 2304), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                                 ("head_dim", 256), ("num_hidden_layers", 26), ("rms_norm_eps", 1e-6),
                                 ("sliding_window", 4096), ("sliding_window_pattern", 6),
                                 ("max_position_embeddings", 131072), ("rope_theta", 1000000.0),
                                 ("rope_local_base_freq", 10000.0))),
    "phi3": ModelType(bias=False),
    "glm4": ModelType(bias_default=True, layers="none"),
    "glm4_moe": ModelType(qk_norm="use_qk_norm", layers="none"),
    "gpt_oss": ModelType(sinks=True, bias_default=True, layers="alternate"),
}
# Wrappers whose text model is in ``text_config`` (Gemma 3's multimodal checkpoints).
TEXT_CONFIG_TYPES = {"gemma3": "gemma3_text"}
# Attention designs flintgen does not implement, named in the refusal.
UNSUPPORTED_ATTENTION = {
    "deepseek_v2": "multi-head latent attention (MLA)", "deepseek_v3": "multi-head latent attention (MLA)",
    "kimi_k2": "multi-head latent attention (MLA)",
}
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn", "longrope": "longrope"}
# The rope_scaling keys each type reads (transformers' modeling_rope_utils), kept in rope_scaling_params.
_ROPE_KEYS = {
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"),
}
_HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
# RoPE facts config.json does not state (transformers' modeling / configuration code of the model type):
# pairs (2i, 2i+1) instead of NeoX's (i, i + R/2) ...
ROPE_STYLES = {"glm": "interleaved", "glm4": "interleaved"}
# ... and the partial_rotary_factor the config class assumes when config.json has none.
PARTIAL_ROTARY_DEFAULTS = {"glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rope_entry(cfg: dict[str, Any], where: str, d: Any, flat: bool, theta_default: Any,
                problems: list[str]) -> tuple | None:
    """(theta, scaling, params, partial_rotary_factor) of one rope_parameters entry, or None."""
    if d is None:
        problems.append(f"{where}: null (layers without RoPE) is not supported")
        return None
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type == "su" or (cfg.get("model_type") == "phi3" and rope_type == "yarn"):
        rope_type = "longrope"  # as transformers' Phi3Config
    if rope_type not in _ROPE_TYPES:
        at = "" if where == "rope_scaling" else f" (in {where})"
        problems.append(f"rope_scaling.rope_type {rope_type!r}{at}: supported are {sorted(_ROPE_TYPES)}")
        return None
    kind = _ROPE_TYPES[rope_type]
    theta = d.get("rope_theta", theta_default)
    if theta is None:
        problems.append("rope_theta: missing")
        return None
    prf = d.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                 PARTIAL_ROTARY_DEFAULTS.get(cfg.get("model_type"), 1.0)))
    params = {k: d[k] for k in _ROPE_KEYS[kind] if d.get(k) is not None}
    if "truncate" in params:  # yarn's "truncate": false
        params["truncate"] = float(params["truncate"])
    if kind in ("llama3", "yarn", "longrope"):
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3)
        # wins over the flat rope_scaling's; the default is max_position_embeddings.
        if flat and cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif "original_max_position_embeddings" not in params and cfg.get("max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    if kind in ("yarn", "longrope") and "factor" not in params:
        mx, orig = cfg.get("max_position_embeddings"), params.get("original_max_position_embeddings")
        if _is_number(mx) and _is_number(orig) and orig:
            params["factor"] = mx / orig  # as transformers (Phi-3: 131072 / 4096)
    return theta, kind, params, prf


def rope_fields_from_hf_config(cfg: dict[str, Any], head_dim: int, layer_types: tuple[str, ...] = ("full",)
                               ) -> tuple[dict[str, Any], list[str]]:
    """The Spec's RoPE fields (rope_style, rope_theta, rope_scaling(_params),
    rotary_dim, sliding_rope_*) of a config.json dict for a model of the given
    flintgen ``layer_types``, and the problems found (messages)."""
    problems: list[str] = []
    rs, rp = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for key, val in (("rope_scaling", rs), ("rope_parameters", rp)):
        if val is not None and not isinstance(val, dict):
            problems.append(f"{key}: {val!r} is not an object (expected e.g. {{\"rope_type\": \"llama3\", ...}})")
    rs = rs if isinstance(rs, dict) else None
    rp = rp if isinstance(rp, dict) else None
    hf_types = set(cfg.get("layer_types") or ()) | set(_HF_LAYER_TYPES)
    nested = [k for k in (rp or {}) if k in hf_types]
    needed = [t for t in ("full", "sliding") if t in layer_types]
    entries: dict[str, tuple] = {}
    if nested:
        for k in nested:
            if k not in _HF_LAYER_TYPES:
                problems.append(f"rope_parameters[{k!r}]: layer type not supported (supported: "
                                f"{sorted(_HF_LAYER_TYPES)})")
        for t in needed:
            k = {v: k for k, v in _HF_LAYER_TYPES.items()}[t]
            if k not in rp:
                problems.append(f"rope_parameters: no {k!r} entry for the model's {k} layers")
                continue
            theta = cfg.get("rope_theta")
            if t == "sliding" and cfg.get("rope_local_base_freq") is not None:
                theta = cfg["rope_local_base_freq"]
            e = _rope_entry(cfg, f"rope_parameters[{k!r}]", rp[k], False, theta, problems)
            if e is not None:
                entries[t] = e
    else:
        where = "rope_scaling" if rs else "rope_parameters"
        e = _rope_entry(cfg, where, rs or rp or {}, True, cfg.get("rope_theta"), problems)
        if e is not None:
            entries["full"] = e
            entries["sliding"] = e
            if cfg.get("rope_local_base_freq") is not None:  # Gemma 3: sliding layers unscaled, own theta
                entries["sliding"] = (cfg["rope_local_base_freq"], "none", {}, e[3])
    used = [entries[t] for t in needed if t in entries]
    if not used:
        return {}, problems
    prfs = sorted({float(e[3]) if _is_number(e[3]) else e[3] for e in used}, key=repr)
    if len(prfs) > 1:
        problems.append(f"partial_rotary_factor: differs between layer types ({prfs}); flintgen has one rotary_dim")
    prf = prfs[0]
    if not _is_number(prf) or not 0 < prf <= 1:
        problems.append(f"partial_rotary_factor: {prf!r} is not a number in (0, 1]")
        prf = 1.0
    main = entries.get("full", used[0])
    fields: dict[str, Any] = dict(
        rope_style=ROPE_STYLES.get(cfg.get("model_type"), "neox"),
        rope_theta=float(main[0]) if _is_number(main[0]) else main[0],
        rope_scaling=main[1], rope_scaling_params=main[2], rotary_dim=int(head_dim * prf))
    sl = entries.get("sliding")
    if "sliding" in layer_types and sl is not None and sl[:3] != main[:3]:
        fields.update(sliding_rope_theta=float(sl[0]) if _is_number(sl[0]) else sl[0],
                      sliding_rope_scaling=sl[1], sliding_rope_scaling_params=sl[2])
    return fields, problems


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read Hugging Face config {path!r}: {e.strerror}. Check the path.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"Hugging Face config {path!r} is not valid JSON ({e}): pass the model's "
                         "config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"Hugging Face config {path!r} holds a JSON {type(cfg).__name__}, not an object: "
                         "pass the model's config.json")
    return cfg


def _layer_kinds(cfg: dict[str, Any], mt: ModelType, problems: list[str]) -> tuple[tuple[str, ...], Any]:
    """(flintgen layer_types, the sliding layers' window or None), as the
    model type's config class derives them (``ModelType.layers``)."""
    n = cfg.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        bad = sorted({t for t in cfg["layer_types"] if t not in _HF_LAYER_TYPES})
        if bad:
            problems.append(f"layer_types: unsupported entries {bad} (supported: {sorted(_HF_LAYER_TYPES)})")
        kinds = tuple(_HF_LAYER_TYPES.get(t, "full") for t in cfg["layer_types"])
    else:
        used = bool(cfg.get("use_sliding_window", False))
        max_w = cfg.get("max_window_layers", n)
        sliding = {
            "none": lambda i: False,
            "all": lambda i: bool(window),
            "all_if_used": lambda i: bool(window) and used,
            "alternate": lambda i: i % 2 == 0,
            "pattern": lambda i: bool((i + 1) % (cfg.get("sliding_window_pattern") or 6)),
            "from_max": lambda i: bool(window) and used and i >= max_w,
            "alternate_below_max": lambda i: bool(window) and used and i % 2 == 0 and i < max_w,
        }[mt.layers]
        kinds = tuple("sliding" if sliding(i) else "full" for i in range(n))
    mpe = cfg.get("max_position_embeddings")
    if "sliding" in kinds and _is_number(window) and _is_number(mpe) and window >= mpe:
        # A window of at least the model's whole context never excludes a token (Phi-4-mini: 262144 of
        # 131072): full attention, the same results without a sliding code path.
        kinds = tuple("full" for _ in kinds)
    if "sliding" in kinds and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        problems.append(f"sliding_window: {window!r} is not a positive int, but layers {kinds.index('sliding')}.. "
                        "slide")
    return kinds, (window if "sliding" in kinds else None)


def _switch(cfg: dict[str, Any], value: bool | str, default: bool) -> bool:
    """``value`` when the type's code fixes it, else the config key it names (``default`` when absent or null)."""
    if isinstance(value, bool):
        return value
    return default if cfg.get(value) is None else bool(cfg[value])


def spec_from_hf_config(cfg: dict[str, Any] | str | os.PathLike, *, tp_size: int = 1, page_size: int = 16,
                        weight_format: str = "bf16", max_batch: int = 256, name: str | None = None,
                        kv_cache_dtype: str = "bf16") -> Spec:
    """Build the spec of a model from its config.json (a dict or a path);
    ``kv_cache_dtype`` "bf16" or "fp8_e4m3" (Spec.kv_cache_dtype)."""
    where = "config"
    if not isinstance(cfg, dict):
        where = f"Hugging Face config {os.fspath(cfg)!r}"
        cfg = _read_config(os.fspath(cfg))
    top_name = cfg.get("_name_or_path")
    if cfg.get("model_type") in TEXT_CONFIG_TYPES:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"cannot map {where} to a flintgen spec: model_type {cfg['model_type']!r} keeps its "
                             f"language model in text_config, which is {text!r}. Pass the full config.json")
        cfg = dict(text, model_type=text.get("model_type", TEXT_CONFIG_TYPES[cfg["model_type"]]))
    problems: list[str] = []
    mt_name = cfg.get("model_type")
    if mt_name not in MODEL_TYPES:
        why = (f"its {UNSUPPORTED_ATTENTION[mt_name]} is not implemented" if mt_name in UNSUPPORTED_ATTENTION
               else "sinks, q/k norm, bias and layer kinds are unknown for it")
        problems.append(f"model_type {mt_name!r}: {why} (supported: {sorted(MODEL_TYPES) + sorted(TEXT_CONFIG_TYPES)})")
    mt = MODEL_TYPES.get(mt_name, ModelType())
    defaults = dict(mt.defaults)
    cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None or k not in defaults}}
    for req in ("hidden_size", "num_attention_heads"):
        if not isinstance(cfg.get(req), int):
            problems.append(f"{req}: missing or not an int ({cfg.get(req)!r})")
    hidden, nq = cfg.get("hidden_size", 0), cfg.get("num_attention_heads", 1)
    nkv = cfg.get("num_key_value_heads") or nq
    head_dim = cfg.get("head_dim") or (hidden // nq if isinstance(hidden, int) and isinstance(nq, int) and nq else 0)
    if cfg.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention: true (an encoder, not causal decoding) is not supported")
    layer_types, window = _layer_kinds(cfg, mt, problems)
    softcap = cfg.get("attn_logit_softcapping")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        problems.append(f"attn_logit_softcapping: {softcap!r} is not a finite number > 0 (the logit cap) "
                        "or null (no capping)")
    scale = None
    if mt.scale_key is not None:
        s = cfg.get(mt.scale_key, mt.scale_default)
        if not _is_number(s) or s <= 0:
            problems.append(f"{mt.scale_key}: {s!r} is not a number > 0 (the softmax scale is its ** -0.5)")
        elif isinstance(head_dim, int) and head_dim and float(s) != float(head_dim):
            scale = float(s) ** -0.5
    rope, rope_problems = rope_fields_from_hf_config(cfg, head_dim if isinstance(head_dim, int) else 0, layer_types)
    problems += rope_problems
    if problems:
        raise ValueError(f"cannot map {where} to a flintgen spec: " + "; ".join(problems) +
                         ". Fix the config, or write a flintgen spec file and pass it with --spec")
    try:
        return Spec(
            name=name or top_name or cfg.get("_name_or_path") or mt_name, hidden_size=hidden, num_q_heads=nq,
            num_kv_heads=nkv, head_dim=head_dim, page_size=page_size, kv_cache_dtype=kv_cache_dtype, kv_layout="HND",
            weight_format=weight_format, qkv_bias=_switch(cfg, mt.bias, mt.bias_default), sinks=mt.sinks,
            attn_logit_softcap=softcap is not None, sliding_window=window, layer_types=layer_types,
            qk_norm=_switch(cfg, mt.qk_norm, mt.qk_norm_default), norm_weight_offset=mt.norm_weight_offset,
            softmax_scale=scale, **rope,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_tokens=8, tp_size=tp_size, max_batch=max_batch,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where} maps to a spec flintgen does not support: {e}") from None
