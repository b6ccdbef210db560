"""Per-head RMSNorm and NeoX rotary embedding, fp32 math.

Provenance: written for flintgen's fused QKV GEMV; numerics follow vLLM's
``RMSNorm`` (fp32 mean of squares, ``x * rsqrt(mean + eps) * w``) and NeoX
``get_rope`` (``cos_sin_cache[pos] = cat(cos, sin)``, each ``head_dim / 2``
fp32) without their intermediate bf16 roundings: one rounding at the end.

NeoX pairs element ``d`` with ``d + D/2`` (``d < D/2``)::

    out[d]       = x[d] * cos[pos, d] - x[d + D/2] * sin[pos, d]
    out[d + D/2] = x[d + D/2] * cos[pos, d] + x[d] * sin[pos, d]
"""

from __future__ import annotations

from cutlass import Float32

from flintgen.device import ptx


def rms_scale(sum_sq, inv_dim: float, eps):
    """``rsqrt(sum_sq / D + eps)`` (MUFU.RSQ, ~2 fp32 ulp)."""
    return ptx.rsqrt(sum_sq * Float32(inv_dim) + eps)


def rope_neox(x1, x2, c, s):
    """Rotate the pair (x1 = x[d], x2 = x[d + D/2]) by the angle with cos ``c``,
    sin ``s``; fp32."""
    return x1 * c - x2 * s, x2 * c + x1 * s
