"""The fp8 KV cache's per-layer scales, as the QKV step and decode attention
both take them (cute-free): ``k_scale`` and ``v_scale``, one fp32 element
each on the CUDA device (vLLM's ``layer._k_scale`` / ``_v_scale``),
dequantized value = e4m3 x scale, read by the kernels before their
grid-dependency wait (a captured graph sees values updated in place)."""

from __future__ import annotations

import math

NAMES = ("k_scale", "v_scale")


def check_scales(spec, k_scale, v_scale) -> list:
    """Host checks: for an fp8 spec both scales are required, one-element
    fp32 tensors (4-byte aligned as every fp32 tensor); for a bf16 spec both
    must be None. Returns
    [(name, tensor)] for the device-side checks (empty for bf16)."""
    import torch

    dt = spec.kv_cache_dtype
    pairs = list(zip(NAMES, (k_scale, v_scale)))
    if dt != "fp8_e4m3":
        for name, t in pairs:
            if t is not None:
                raise ValueError(f"{name} given but spec {spec.name!r} has kv_cache_dtype={dt!r} (K / V stored "
                                 f"unscaled): pass {name}=None, or build a spec with kv_cache_dtype='fp8_e4m3'")
        return []
    for name, t in pairs:
        if t is None:
            raise ValueError(f"spec {spec.name!r} has kv_cache_dtype='fp8_e4m3': pass {name}, the layer's fp32 "
                             f"{name[0].upper()} scale as a one-element CUDA tensor (dequantized = e4m3 x {name}; "
                             f"vLLM's layer._{name}), e.g. torch.tensor([s], dtype=torch.float32, device='cuda'), "
                             "1.0 where the checkpoint has none")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a one-element fp32 torch.Tensor (read by the kernel at every launch, "
                            f"so CUDA graphs see updates), got {type(t).__name__} {t!r}: pass e.g. "
                            f"torch.tensor([{t!r}], dtype=torch.float32, device='cuda')")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {t.dtype}: convert it with .float()")
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one fp32 value (one scale per layer), got shape {tuple(t.shape)}: "
                             "per-kv-head scale vectors are not supported; use one per-layer scale (e.g. the max "
                             "of the per-head scales, requantizing the cache with it)")
    return pairs


def check_scale_values(k_scale, v_scale) -> None:
    """FLINTGEN_CHECK_INPUTS=1: both scales finite and > 0 (synchronizes;
    any device)."""
    for name, t in zip(NAMES, (k_scale, v_scale)):
        x = float(t.reshape(()).item())
        if not math.isfinite(x) or x <= 0:
            raise ValueError(f"{name} = {x!r} must be finite and > 0 (dequantized = e4m3 x {name}): pass the "
                             f"layer's {name} (its calibrated value; 1.0 where the checkpoint has none)")
