"""Per-head RMSNorm and rotary embedding (NeoX and interleaved pairing, whole
head or partial rotary), fp32 math.

Provenance: written for flintgen's fused QKV GEMV; numerics follow vLLM's
``RMSNorm`` (fp32 mean of squares, ``x * rsqrt(mean + eps) * w``; Gemma's
``(1 + w)`` with ``1 + w`` in fp32) and ``get_rope`` (``cos_sin_cache[pos] =
cat(cos, sin)``, each ``R / 2`` fp32, R = rotary_dim) without their
intermediate bf16 roundings: one rounding at the end.

RoPE rotates the first R dims of a head of D; dims R..D-1 pass through. Pair
i (< R/2) is rotated by the angle of table column i (cos) / R/2 + i (sin)::

    neox (rotate-half):   (a, b) = (x[i], x[i + R/2])
    interleaved (GPT-J):  (a, b) = (x[2i], x[2i + 1])

    a' = a * cos[pos, i] - b * sin[pos, i]
    b' = b * cos[pos, i] + a * sin[pos, i]
"""

from __future__ import annotations

from cutlass import Float32

from flintgen.device import ptx


def rms_scale(sum_sq, inv_dim: float, eps):
    """``rsqrt(sum_sq / D + eps)`` (MUFU.RSQ, ~2 fp32 ulp)."""
    return ptx.rsqrt(sum_sq * Float32(inv_dim) + eps)


def norm_weight(w, offset: int):
    """The factor a stored RMSNorm weight ``w`` (fp32 value of a bf16) scales
    by: ``w``, or ``w + 1`` in fp32 for ``offset`` 1 (Gemma: exact as fp32 add,
    not rounded back to bf16)."""
    return w if offset == 0 else w + Float32(float(offset))


def rope_neox(x1, x2, c, s):
    """Rotate the pair (x1 = a, x2 = b) by the angle with cos ``c``, sin ``s``;
    fp32. The same for both pairings: only which elements form a pair differs."""
    return x1 * c - x2 * s, x2 * c + x1 * s


def deinterleave(vals):
    """Elements [2i0, 2i0 + 2P) of a head (interleaved pairing) -> (a [P], b [P])
    of pairs i0 .. i0 + P - 1."""
    return list(vals[0::2]), list(vals[1::2])


def interleave(a, b):
    """(a [P], b [P]) -> [a0, b0, a1, b1, ...] (the elements' order in the head)."""
    out = []
    for i in range(len(a)):
        out += [a[i], b[i]]
    return out
