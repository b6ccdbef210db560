"""RoPE cos|sin tables: ``rope_table(spec, max_pos, device)``.

Layout: fp32 ``[max_pos, head_dim]``; row p is ``cos(p·f_i)·a`` for i < D/2
followed by ``sin(p·f_i)·a``, the NeoX (rotate-half) convention, where f_i
are the inverse frequencies of the spec's scaling and ``a`` its attention
factor (YaRN's mscale; 1 otherwise).

Inverse frequencies are computed in fp32 exactly as Hugging Face transformers
(``modeling_rope_utils``) computes them; the angles p·f_i and their cos/sin in
fp64, so large positions stay accurate (fp32 p·f loses ~1e-2 rad at 128k).
"""

from __future__ import annotations

import math

from flintgen.spec import Spec


def _default_inv_freq(theta: float, dim: int):
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(theta: float, dim: int, p: dict):
    import torch

    inv_freq = _default_inv_freq(theta, dim)
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: dict):
    import torch

    factor = p["factor"]
    orig = p["original_max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
        else:
            attn = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


_REQUIRED = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings")}


def inv_freq_and_factor(spec: Spec):
    """(fp32 inverse frequencies [head_dim/2], attention factor) of the spec."""
    dim, theta, kind = spec.head_dim, spec.rope_theta, spec.rope_scaling
    params = dict(spec.rope_scaling_params)
    missing = [k for k in _REQUIRED.get(kind, ()) if k not in params]
    if missing:
        raise ValueError(f"rope_scaling '{kind}' needs rope_scaling_params {missing}; got {sorted(params)}. "
                         "Add them to the spec (they come from config.json's rope_scaling).")
    if kind == "none":
        return _default_inv_freq(theta, dim), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(theta, dim, params), 1.0
    return _yarn(theta, dim, params)


def rope_table(spec: Spec, max_pos: int, device=None):
    """The fp32 ``[max_pos, head_dim]`` cos|sin table for the spec."""
    import torch

    if spec.rope_style == "none":
        raise ValueError(f"spec {spec.name!r} has rope_style 'none': it needs no RoPE table")
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        raise ValueError(f"max_pos must be a positive int, got {max_pos!r}")
    inv, attn = inv_freq_and_factor(spec)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv.double()[None, :]
    table = torch.cat([ang.cos(), ang.sin()], dim=1) * attn
    return table.float().to(device) if device is not None else table.float()
