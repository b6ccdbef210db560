"""References for the fused QKV step (cute-free, torch only).

* ``gemv_ref``: the fp64 product ``xn @ W^T (+ bias)`` of the same
  (dequantized) weights, and ``sum |xn| |W|`` for the fp32-accumulation floor.
* ``qk_norm_rope_ref``: fp32 per-head RMSNorm and NeoX RoPE applied to given
  pre-norm rows (the kernel's own, from its debug output), one rounding.
* ``within_ulp``: the test criterion ``|out - ref| <= ulp_bf16(ref) + floor``.
"""

from __future__ import annotations


def gemv_ref(xn, w, bias=None):
    """(fp64 [M, N] product xn @ w^T + bias, fp64 sum |xn| |w| per output)."""
    x64, w64 = xn.double(), w.double().to(xn.device)
    ref = x64 @ w64.T
    if bias is not None:
        ref = ref + bias.double()
    return ref, x64.abs() @ w64.abs().T


def bf16_ulp(ref):
    """One bf16 ulp at each element of ``ref`` (the binade's spacing)."""
    import torch

    a = ref.abs().double().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def within_ulp(out, ref, floor=None, nulp: float = 1.0):
    """Boolean mask of elements with ``|out - ref| <= nulp * ulp(ref) + floor``."""
    err = (out.double() - ref.double()).abs()
    tol = nulp * bf16_ulp(ref)
    if floor is not None:
        tol = tol + floor
    return err <= tol


def qk_norm_rope_ref(pre, head_dim: int, norm_weight=None, eps: float = 1e-6, cos_sin=None,
                     positions=None):
    """pre: [M, H * D] bf16 rows of H heads -> fp32 [M, H * D] (norm, rope)
    and the fp32 magnitude |a| + |b| of the two products of each rotated
    output (the floor below which fp32 cannot resolve a cancellation)."""
    import torch

    m, hd = pre.shape
    d = head_dim
    x = pre.float().view(m, hd // d, d)
    if norm_weight is not None:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = x * rstd * norm_weight.float()
    mag = x.abs()
    if cos_sin is not None:
        cs = cos_sin[positions.long()].float()             # [M, D]
        c, s = cs[:, None, : d // 2], cs[:, None, d // 2:]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        a1, b1 = x1 * c, x2 * s
        a2, b2 = x2 * c, x1 * s
        x = torch.cat([a1 - b1, a2 + b2], dim=-1)
        mag = torch.cat([a1.abs() + b1.abs(), a2.abs() + b2.abs()], dim=-1)
    return x.reshape(m, hd), mag.reshape(m, hd)
