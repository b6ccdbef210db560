"""References for the fused QKV step (cute-free, torch only).

* ``gemv_ref``: the fp64 product ``xn @ W^T (+ bias)`` of the same
  (dequantized) weights, and ``sum |xn| |W|`` for the fp32-accumulation floor.
* ``qk_norm_rope_ref``: fp32 per-head RMSNorm and RoPE applied to given
  pre-norm rows (the kernel's own, from its debug output), one rounding. RoPE
  rotates the first R dims of each head, R the table's width
  (``spec.rope_dim``; the rest pass through), pairing (x[i], x[i + R/2])
  for ``rope_style="neox"`` and (x[2i], x[2i + 1]) for "interleaved" (GPT-J /
  GLM-4), both with table columns i (cos) and R/2 + i (sin).
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


_ROPE_STYLES = ("neox", "interleaved")


def _rotate(x, cs, rope_style: str):
    """x [M, H, D], cs [M, R] cos | sin rows (x's dtype): (rotated x, |a| + |b| per
    rotated output and |x| per passed-through one)."""
    import torch

    if rope_style not in _ROPE_STYLES:
        raise ValueError(f"rope_style {rope_style!r} is not supported: supported values are {list(_ROPE_STYLES)}")
    d, r = x.shape[-1], cs.shape[-1]
    if r % 2 or not 2 <= r <= d:
        raise ValueError(f"cos_sin must be [max_pos, R] with R even in 2..{d}, got width {r}")
    c, s = cs[:, None, : r // 2], cs[:, None, r // 2:]
    rot, rest = x[..., :r], x[..., r:]
    if rope_style == "neox":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    a1, b1 = x1 * c, x2 * s
    a2, b2 = x2 * c, x1 * s
    o1, o2 = a1 - b1, a2 + b2
    m1, m2 = a1.abs() + b1.abs(), a2.abs() + b2.abs()
    if rope_style == "neox":
        out, mag = torch.cat([o1, o2], -1), torch.cat([m1, m2], -1)
    else:  # back to (2i, 2i + 1) order
        out, mag = torch.stack([o1, o2], -1).flatten(-2), torch.stack([m1, m2], -1).flatten(-2)
    return torch.cat([out, rest], -1), torch.cat([mag, rest.abs()], -1)


def qk_norm_rope_ref(pre, head_dim: int, norm_weight=None, eps: float = 1e-6, cos_sin=None,
                     positions=None, rope_style: str = "neox", norm_weight_offset: int = 0):
    """pre: [M, H * D] bf16 rows of H heads -> fp32 [M, H * D] (norm, rope)
    and the fp32 magnitude |a| + |b| of the two products of each rotated
    output (the floor below which fp32 cannot resolve a cancellation; |x| for
    the dims that pass through). The norm is over all D dims and scales by
    ``w + norm_weight_offset`` in fp32 (Gemma's ``1 + w``: 1). ``cos_sin``
    [max_pos, R] (R <= D, even): the first R dims of each head rotate, paired
    per ``rope_style``."""
    import torch

    if norm_weight_offset not in (0, 1):
        raise ValueError(f"norm_weight_offset must be 0 or 1, got {norm_weight_offset!r}")
    m, hd = pre.shape
    d = head_dim
    x = pre.float().view(m, hd // d, d)
    if norm_weight is not None:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        w = norm_weight.float()
        if norm_weight_offset:
            w = w + float(norm_weight_offset)    # fp32 add, as the kernel (not bf16(1 + w))
        x = x * rstd * w
    mag = x.abs()
    if cos_sin is not None:
        x, mag = _rotate(x, cos_sin[positions.long()].float(), rope_style)
    return x.reshape(m, hd), mag.reshape(m, hd)


def rope_ref(x, cos_sin, positions, rope_style: str = "neox"):
    """fp64 RoPE of ``x`` [M, H, D] at ``positions`` [M] with the
    ``[max_pos, R]`` cos | sin table: the first R dims of each head rotate
    (pairing per ``rope_style``), the rest pass through."""
    return _rotate(x.double(), cos_sin[positions.long()].double(), rope_style)[0]
