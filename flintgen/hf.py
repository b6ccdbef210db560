"""Map a Hugging Face ``config.json`` to a flintgen ``Spec``.

Read from config.json: num_attention_heads, num_key_value_heads (default: MHA),
head_dim (or hidden_size // num_attention_heads), hidden_size, rms_norm_eps,
attention_bias, sliding_window with layer_types (or use_sliding_window),
rope_theta and rope_scaling (default, llama3, yarn; also the transformers-5
``rope_parameters`` form), attn_logit_softcapping (non-null: the spec's
``attn_logit_softcap``; the cap itself is decode attention's ``softcap``
argument). From the model type (config.json does not say):
attention sinks and per-head q/k RMSNorm, per ``MODEL_TYPES``.

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
_ROPE_TYPES = {"default": "none", "llama3": "llama3", "yarn": "yarn"}
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")


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

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        problems.append(f"rope_scaling: {rope!r} is not an object (expected e.g. {{\"rope_type\": \"llama3\", ...}})")
        rope = {}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type not in _ROPE_TYPES:
        problems.append(f"rope_scaling.rope_type {rope_type!r}: supported are {sorted(_ROPE_TYPES)}")
        rope_type = "default"
    if theta is None:
        problems.append("rope_theta: missing")
        theta = 10000.0
    params = {k: float(v) if isinstance(v, bool) else v  # yarn's "truncate": false
              for k, v in ((k, rope.get(k)) for k in _ROPE_KEYS) if v is not None}

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
    if problems:
        raise ValueError(f"cannot map {where} to a flintgen spec: " + "; ".join(problems) +
                         ". Fix the config, or write a flintgen spec file and pass it with --spec")
    try:
        return Spec(
            name=name or cfg.get("_name_or_path") or mt, hidden_size=hidden, num_q_heads=nq, num_kv_heads=nkv,
            head_dim=head_dim, page_size=page_size, kv_cache_dtype="bf16", kv_layout="HND",
            weight_format=weight_format, qkv_bias=bool(cfg.get("attention_bias", False)), sinks=sinks,
            attn_logit_softcap=softcap is not None, sliding_window=window, layer_types=layer_types,
            qk_norm=qk_norm, rope_style="neox",
            rope_theta=float(theta), rope_scaling=_ROPE_TYPES[rope_type], rope_scaling_params=params,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_tokens=8, tp_size=tp_size, max_batch=max_batch,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where} maps to a spec flintgen does not support: {e}") from None
