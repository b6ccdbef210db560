"""Reference for rms_norm / fused_add_rms_norm."""

from __future__ import annotations


def rms_norm_ref(x, weight, eps, residual=None, offset: int = 0, dtype=None):
    """(xn, r bf16): r = bf16(x + residual) exactly as torch adds bf16;
    xn = f(r) * rsqrt(mean(f(r)^2) + eps) * (f(w) + offset), left unrounded so
    a test can measure the kernel's rounding (<= 1 bf16 ulp). ``offset`` is
    spec.norm_weight_offset (Gemma's 1 + w, as transformers computes it in
    fp32); ``dtype`` the math (torch.float32 by default, or torch.float64)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    r = x if residual is None else (x + residual)  # bf16 add: fp32 math, one rounding
    rf = r.to(dtype)
    rstd = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    return rf * rstd * (weight.to(dtype) + offset), r


def bf16_ulp(ref):
    """One bf16 ulp at each element of the fp32 tensor ``ref``."""
    import torch

    a = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)
