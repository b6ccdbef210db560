"""RoPE cos|sin tables: ``rope_table(spec, max_pos, device, layer_type="full")``.

Layout: fp32 ``[max_pos, R]`` with R = ``spec.rope_dim`` (``rotary_dim``, or
``head_dim`` when unset, so the whole-head table is ``[max_pos, head_dim]`` as
before); row p is ``cos(p·f_i)·a`` for i < R/2 followed by ``sin(p·f_i)·a``,
where f_i are the R/2 inverse frequencies of the layer type's scaling and
``a`` its attention factor (YaRN's mscale, longrope's sqrt(1 + ln s / ln L0);
1 otherwise). vLLM's ``cos_sin_cache`` has the same layout, partial rotary
included.

The layout is the same for both pairings; what differs is which elements of a
head the kernel pairs with frequency i (``flintgen.references.qkv``):

* ``rope_style = "neox"``: (x[i], x[i + R/2]) (rotate-half);
* ``rope_style = "interleaved"`` (GPT-J, GLM-4): (x[2i], x[2i + 1]);

and dims R..head_dim-1 pass through unrotated.

``layer_type`` "sliding" selects the spec's ``sliding_rope_*`` (theta, scaling)
when set (Gemma 3's local RoPE), "full" (or a spec without them) the main one.

Longrope: row p uses the short factors for p < original_max_position_embeddings
and the long factors from there on. That is what transformers' Phi-3 rotary
embedding computes for a decode step of one token at position p (it picks the
long factors when max(position_ids) + 1 > original_max_position_embeddings);
it differs where transformers decides for a whole forward at once: a prefill
longer than the original length rotates all of its tokens (early ones too)
with the long factors, and a batched or multi-token step with any row past the
original length uses the long factors for every row. ``longrope="short"`` /
``"long"`` build a table of one factor set, for a caller that wants to make
that per-forward choice itself.

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


def _linear_inv_freq(theta: float, dim: int, p: dict):
    inv_freq = _default_inv_freq(theta, dim)
    inv_freq /= p["factor"]  # in place, as transformers (same fp32 rounding)
    return inv_freq


def _longrope_attention_factor(p: dict) -> float:
    attn = p.get("attention_factor")
    if attn is not None:
        return float(attn)
    factor, orig = p["factor"], p["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _longrope_inv_freq(theta: float, dim: int, p: dict, long: bool):
    import torch

    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta ** shape)


_REQUIRED = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
LAYER_TYPES = ("full", "sliding")
LONGROPE_CHOICES = ("by_position", "short", "long")


def _rope_of(spec: Spec, layer_type: str):
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type {layer_type!r} is not supported: supported values are {list(LAYER_TYPES)}. "
                         "Pass 'full' or 'sliding'.")
    theta, kind, params = spec.rope_for(layer_type)
    params = dict(params)
    prefix = "sliding_" if layer_type == "sliding" and spec.sliding_rope_theta is not None else ""
    missing = [k for k in _REQUIRED.get(kind, ()) if k not in params]
    if kind == "longrope" and "factor" not in params and "attention_factor" not in params:
        missing.append("factor")  # transformers: max_position_embeddings / original_max_position_embeddings
    if missing:
        raise ValueError(f"{prefix}rope_scaling '{kind}' needs {prefix}rope_scaling_params {missing}; got "
                         f"{sorted(params)}. Add them to the spec (they come from config.json's rope_scaling / "
                         "rope_parameters).")
    return theta, kind, params


def inv_freq_and_factor(spec: Spec, layer_type: str = "full", seq_len: int | None = None):
    """(fp32 inverse frequencies [rope_dim/2], attention factor) of the layer
    type's RoPE, as transformers' ``ROPE_INIT_FUNCTIONS[type](config, device,
    seq_len)``: for longrope the long factors when ``seq_len`` >
    original_max_position_embeddings, else the short ones."""
    theta, kind, params = _rope_of(spec, layer_type)
    dim = spec.rope_dim
    if kind == "none":
        return _default_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return _linear_inv_freq(theta, dim, params), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(theta, dim, params), 1.0
    if kind == "longrope":
        long = bool(seq_len) and seq_len > params["original_max_position_embeddings"]
        return _longrope_inv_freq(theta, dim, params, long), _longrope_attention_factor(params)
    return _yarn(theta, dim, params)


def rope_table(spec: Spec, max_pos: int, device=None, layer_type: str = "full", longrope: str = "by_position"):
    """The fp32 ``[max_pos, spec.rope_dim]`` cos|sin table of the layer type
    (``[max_pos, head_dim]`` when the whole head rotates). ``longrope``: see
    the module docstring (only read for longrope scaling)."""
    import torch

    if spec.rope_style == "none":
        raise ValueError(f"spec {spec.name!r} has rope_style 'none': it needs no RoPE table")
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        raise ValueError(f"max_pos must be a positive int, got {max_pos!r}")
    if longrope not in LONGROPE_CHOICES:
        raise ValueError(f"longrope {longrope!r} is not supported: supported values are {list(LONGROPE_CHOICES)}. "
                         "Pass one of them.")
    _, kind, params = _rope_of(spec, layer_type)
    pos = torch.arange(max_pos, dtype=torch.float64)[:, None]
    if kind == "longrope":
        orig = params["original_max_position_embeddings"]
        short, attn = inv_freq_and_factor(spec, layer_type, seq_len=None)
        long, _ = inv_freq_and_factor(spec, layer_type, seq_len=int(orig) + 1)
        if longrope == "by_position":  # row p: what a one-token step at p computes (seq_len p + 1)
            inv = torch.where(pos + 1 > orig, long.double()[None, :], short.double()[None, :])
        else:
            inv = (long if longrope == "long" else short).double()[None, :]
    else:
        inv, attn = inv_freq_and_factor(spec, layer_type)
        inv = inv.double()[None, :]
    ang = pos * inv
    table = torch.cat([ang.cos(), ang.sin()], dim=1) * attn
    return table.float().to(device) if device is not None else table.float()
