"""Map a Hugging Face ``config.json`` to a flintgen ``Spec``.

Read from config.json: num_attention_heads, num_key_value_heads (default: MHA),
head_dim (or hidden_size // num_attention_heads), hidden_size, rms_norm_eps,
attention_bias, sliding_window with layer_types (or use_sliding_window),
attn_logit_softcapping (non-null: the spec's ``attn_logit_softcap``; the cap
itself is decode attention's ``softcap`` argument), and the RoPE (``rope_fields_from_hf_config``): rope_theta, partial_rotary_factor
and rope_scaling (default, linear, llama3, yarn, longrope), in the older keys
(rope_scaling / rope_theta / partial_rotary_factor, Gemma 3's
rope_local_base_freq for its sliding layers) or the transformers-5
``rope_parameters``, flat or keyed by layer type ({"full_attention": {...},
"sliding_attention": {...}}). From the model type (config.json does not say):
attention sinks and per-head q/k RMSNorm, per ``MODEL_TYPES``; the RoPE
pairing and default partial rotary factor per ``ROPE_STYLES`` /
``PARTIAL_ROTARY_DEFAULTS``.

Not in config.json, so given here (defaults): page_size 16, kv_layout HND,
kv_cache_dtype bf16, weight_format bf16, max_batch 256, max_tokens 8, tp_size 1.
With tp_size above the kv-head count, kv heads are replicated (one per rank);
tp_size must then be a multiple of the kv-head count.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from flintgen.spec import Spec

# model_type -> (attention sinks, q/k RMSNorm)
MODEL_TYPES = {
    "gpt_oss": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (False, False),
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


def spec_from_hf_config(cfg: dict[str, Any] | str | os.PathLike, *, tp_size: int = 1, page_size: int = 16,
                        weight_format: str = "bf16", max_batch: int = 256, name: str | None = None) -> Spec:
    """Build the spec of a model from its config.json (a dict or a path)."""
    where = "config"
    if not isinstance(cfg, dict):
        where = f"Hugging Face config {os.fspath(cfg)!r}"
        cfg = _read_config(os.fspath(cfg))
    problems: list[str] = []
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        problems.append(f"model_type {mt!r}: sinks and q/k norm are unknown for it (known: {sorted(MODEL_TYPES)}); "
                        "write a flintgen spec file instead")
        sinks, qk_norm = False, False
    else:
        sinks, qk_norm = MODEL_TYPES[mt]
    for req in ("hidden_size", "num_attention_heads"):
        if not isinstance(cfg.get(req), int):
            problems.append(f"{req}: missing or not an int ({cfg.get(req)!r})")
    hidden, nq = cfg.get("hidden_size", 0), cfg.get("num_attention_heads", 1)
    nkv = cfg.get("num_key_value_heads") or nq
    head_dim = cfg.get("head_dim") or (hidden // nq if isinstance(hidden, int) and isinstance(nq, int) and nq else 0)

    layers = cfg.get("num_hidden_layers")
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        table = {"sliding_attention": "sliding", "full_attention": "full"}
        bad = sorted({t for t in cfg["layer_types"] if t not in table})
        if bad:
            problems.append(f"layer_types: unsupported entries {bad} (supported: {sorted(table)})")
        layer_types = tuple(table.get(t, "full") for t in cfg["layer_types"])
    elif window and cfg.get("use_sliding_window", True):
        layer_types = ("sliding",) * (layers or 1)
    else:
        layer_types = ("full",) * (layers or 1)
    if "sliding" not in layer_types:
        window = None
    softcap = cfg.get("attn_logit_softcapping")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        problems.append(f"attn_logit_softcapping: {softcap!r} is not a finite number > 0 (the logit cap) "
                        "or null (no capping)")
    rope, rope_problems = rope_fields_from_hf_config(cfg, head_dim if isinstance(head_dim, int) else 0, layer_types)
    problems += rope_problems
    if problems:
        raise ValueError(f"cannot map {where} to a flintgen spec: " + "; ".join(problems) +
                         ". Fix the config, or write a flintgen spec file and pass it with --spec")
    try:
        return Spec(
            name=name or cfg.get("_name_or_path") or mt, hidden_size=hidden, num_q_heads=nq, num_kv_heads=nkv,
            head_dim=head_dim, page_size=page_size, kv_cache_dtype="bf16", kv_layout="HND",
            weight_format=weight_format, qkv_bias=bool(cfg.get("attention_bias", False)), sinks=sinks,
            attn_logit_softcap=softcap is not None, sliding_window=window, layer_types=layer_types,
            qk_norm=qk_norm, **rope,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_tokens=8, tp_size=tp_size, max_batch=max_batch,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where} maps to a spec flintgen does not support: {e}") from None
