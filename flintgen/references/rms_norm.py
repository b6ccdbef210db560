"""Reference for rms_norm / fused_add_rms_norm."""

from __future__ import annotations


def rms_norm_ref(x, weight, eps, residual=None):
    """(xn fp32, r bf16): r = bf16(x + residual) exactly as torch adds bf16;
    xn = f32(r) * rsqrt(mean(f32(r)^2) + eps) * f32(w), left in fp32 so a test
    can measure the kernel's rounding (<= 1 bf16 ulp)."""
    import torch

    r = x if residual is None else (x + residual)  # bf16 add: fp32 math, one rounding
    rf = r.float()
    rstd = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    return rf * rstd * weight.float(), r


def bf16_ulp(ref):
    """One bf16 ulp at each element of the fp32 tensor ``ref``."""
    import torch

    a = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)
