"""NVFP4 quantization helpers and RoPE tables (torch, cute-free).

The NVFP4 convention is that of ModelOpt checkpoints as vLLM loads them (see
``flintgen.device.nvfp4`` for the byte layout the kernel reads):

* ``weight``: uint8 ``[N, K/2]``, even k in the low nibble, e2m1 codes
  (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6);
* ``weight_scale``: float8_e4m3fn, one per 16 consecutive k of a row, padded
  to ``[roundup(N, 128), roundup(K/16, 4)]`` with zeros and 128x4-swizzled;
* ``weight_scale_2`` (global scale): fp32, ``amax(|W|) / (6 * 448)``; it
  multiplies: ``W = e2m1 * e4m3 * weight_scale_2``.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------- scale swizzle
def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[N, K/16]`` scales -> padded, 128x4-swizzled ``[Np, Kp]``.

    ``[Np, Kp]`` viewed as ``[Np/128, 4, 32, Kp/4, 4]`` (row = 128 rb + 32 i + j,
    col = 4 cb + l) is stored as ``[Np/128, Kp/4, 32, 4, 4]`` (rb, cb, j, i, l).
    Padding rows/columns are zero.
    """
    n, kb = scales.shape
    np_, kp = _roundup(n, 128), _roundup(kb, 4)
    padded = torch.zeros(np_, kp, dtype=scales.dtype, device=scales.device)
    padded[:n, :kb] = scales
    t = padded.view(torch.uint8) if padded.dtype == torch.float8_e4m3fn else padded
    t = t.reshape(np_ // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).contiguous().reshape(np_, kp)
    return t.view(scales.dtype) if scales.dtype == torch.float8_e4m3fn else t


def unswizzle_scales(swizzled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: ``[Np, Kp]`` -> linear ``[n, k/16]``."""
    np_, kp = swizzled.shape
    is_fp8 = swizzled.dtype == torch.float8_e4m3fn
    t = swizzled.view(torch.uint8) if is_fp8 else swizzled
    t = t.reshape(np_ // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).contiguous().reshape(np_, kp)
    t = t[:n, : k // BLOCK].contiguous()
    return t.view(torch.float8_e4m3fn) if is_fp8 else t


def scale_offset(row: int, col: int, kp: int) -> int:
    """Byte offset of scale (row, 16-value column) in the swizzled layout."""
    return ((row // 128) * (kp // 4) + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


# ---------------------------------------------------------------- e2m1
def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales, |x| <= 6 after clamping)
    -> nearest e2m1 code, ties to the even code (as ModelOpt's rounding)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    # Midpoints between grid values. bucketize puts a value equal to a
    # midpoint in the lower code; ties must go to the code with mantissa bit 0:
    # 0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4 (lower) but 0.75 -> 1.0,
    # 1.75 -> 2, 3.5 -> 4 (upper).
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    code = torch.bucketize(mag, bounds, right=False)
    tie_up = torch.isin(mag, torch.tensor([0.75, 1.75, 3.5], device=x.device))
    code = code + tie_up.long()
    sign = (x < 0) & (code > 0)
    return (code + 8 * sign.long()).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes -> ``[N, K/2]`` bytes, even k in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, kh = packed.shape
    out = torch.empty(n, 2 * kh, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


# ---------------------------------------------------------------- NVFP4
def quantize_nvfp4(w: torch.Tensor, global_scale: float | None = None):
    """``w`` [N, K] (any float dtype, K % 16 == 0) -> ``(packed uint8 [N, K/2],
    scales float8_e4m3fn [Np, Kp] swizzled, global_scale fp32 [])``, all
    three on ``w``'s device (what the QKV op takes as they are).

    ModelOpt's recipe: ``gs = amax(|w|) / (6 * 448)``; per 16-block
    ``s = e4m3(amax_block / 6 / gs)``; codes = nearest e2m1 of ``w / (s * gs)``.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"w must be [N, K] with K a multiple of {BLOCK}, got {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    amax = w.abs().max().item()
    gs = global_scale if global_scale is not None else (amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0)
    gs = torch.tensor(gs, dtype=torch.float32, device=w.device)
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    bmax = blocks.abs().amax(-1)
    s = (bmax / E2M1_MAX / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = s.float() * gs
    scaled = torch.where(denom[..., None] > 0, blocks / denom[..., None].clamp_min(1e-30), torch.zeros_like(blocks))
    codes = e2m1_encode(scaled.reshape(n, k))
    return pack_nibbles(codes), swizzle_scales(s), gs


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale, k: int | None = None,
                     dtype=torch.float32) -> torch.Tensor:
    """Exact dequantization: ``e2m1 * e4m3 * global_scale`` as [N, K] (fp64
    products rounded once to ``dtype``; pass ``torch.float64`` for references)."""
    n = packed.shape[0]
    k = k if k is not None else 2 * packed.shape[1]
    vals = e2m1_decode(unpack_nibbles(packed.cpu())).double()
    sc = unswizzle_scales(scales.cpu(), n, k)
    sc = (sc if sc.dtype == torch.float8_e4m3fn else sc.view(torch.float8_e4m3fn)).float().double()
    gs = torch.as_tensor(global_scale).double().cpu().reshape(())
    out = vals.reshape(n, k // BLOCK, BLOCK) * sc[..., None] * gs
    return out.reshape(n, k).to(dtype)


# ---------------------------------------------------------------- RoPE
def rope_table(spec, max_pos: int, device=None, layer_type: str = "full",
               longrope: str = "by_position") -> torch.Tensor:
    """``[max_pos, spec.rope_dim]`` fp32 ``cat(cos, sin)`` for the spec's layer
    type (``[max_pos, head_dim]`` when the whole head rotates): the one
    implementation in ``flintgen.rope_tables`` (default, linear, llama3, yarn,
    longrope)."""
    from flintgen.rope_tables import rope_table as _table

    return _table(spec, max_pos, device, layer_type=layer_type, longrope=longrope)
