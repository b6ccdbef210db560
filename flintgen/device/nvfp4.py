"""NVFP4 weights on Hopper: layout, in-register dequantization to bf16.

Provenance: written for flintgen's fused QKV GEMV from the NVFP4 convention
of ModelOpt checkpoints as vLLM loads them (no code copied).

Storage (one linear layer, ``N`` output rows, ``K`` inputs)::

    weight        uint8 [N, K/2]      byte j of row n = e2m1(w[n, 2j]) | e2m1(w[n, 2j+1]) << 4
                                      (even k in the LOW nibble)
    weight_scale  e4m3  [Np, Kp]      Np = roundup(N, 128), Kp = roundup(K/16, 4); one scale per
                                      16 consecutive k of a row, 128x4-swizzled (below); padding
                                      entries are zero and never read
    weight_scale_2 fp32 []            global scale, multiplies: w = e2m1 * e4m3 * weight_scale_2

e2m1 nibble ``s e1 e0 m``: magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 for code
``e1 e0 m`` = 0..7 (``e = 0`` is subnormal: ``m / 2``), sign bit 3.

128x4 swizzle (cuBLAS / CUTLASS block-scaled layout): the padded ``[Np, Kp]``
scale matrix is viewed as ``[Np/128, 4, 32, Kp/4, 4]`` (row = 128 rb + 32 i + j,
col = 4 cb + l) and permuted to ``[Np/128, Kp/4, 32, 4, 4]`` (rb, cb, j, i, l), so

    offset(row, col) = (rb * Kp/4 + cb) * 512 + j * 16 + i * 4 + l

A 512-byte block holds the 4 scales (64 k) of 128 rows; row ``r`` and ``r + 8``
of one 32-row group are 128 bytes apart.

Dequantization in registers (Hopper has no FP4 MMA). Values are made exact
bf16 and fed to ``mma.m16n8k16`` with bf16 activations; nothing is rounded
before the fp32 accumulator:

1. ``e2m1x8_to_bf16x2``: 8 nibbles -> 4 bf16x2 *patterns*: the sign goes to
   bit 15, ``e1 e0 m`` to bits 8..6 (the two lowest exponent bits and the top
   mantissa bit), so a pattern's value is exactly ``2^-126 * e2m1`` (bf16
   subnormal when ``e = 0``, which bf16 arithmetic keeps: no ftz on bf16).
   Nibbles ``i`` and ``i + 4`` of a word share a register (lo, hi): the
   activations are paired the same way (``prmt``), since the order of k
   inside a dot product is free.
2. ``e4m3x2_to_bf16x2``: two scale bytes -> ``bf16(scale * 2^118)`` each,
   duplicated in both halves (exact: <= 5 significant bits, 2^109..1.75*2^126).
3. ``mul.rn.bf16x2(pattern, scale')`` = ``e2m1 * scale * 2^-8``: exact
   (<= 5 significant bits, 2^-18..10.5, always a bf16 normal).
The GEMV multiplies its fp32 sum by ``weight_scale_2 * 2^8`` (``ACC_RESCALE``).
Per bf16x2 of weights: 2 logic ops + 1 IMAD (+1/4 shift) + 1 HMUL2.
"""

from __future__ import annotations

from cutlass import Float32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from flintgen.device.ptx import _asm

# The dequantized mma operand is e2m1 * e4m3 * 2^(118 - 126): multiply the
# fp32 sum by 2^8 (folded into the global scale).
SCALE_EXP_BIAS = 118
ACC_RESCALE = 256.0
SWIZZLE_ROWS = 128   # rows of one scale block
SWIZZLE_COLS = 4     # 16-value scale columns of one block (64 k)
SWIZZLE_BLOCK_BYTES = 512


def scale_row_offset(row, k64_steps: int):
    """Byte offset of scale column 0 of ``row`` in the swizzled layout, for
    ``K = 64 * k64_steps`` (``Kp / 4 = k64_steps``, no column padding).
    Column ``4 s + l`` of the row is at ``+ 512 s + l``."""
    return ((row >> 7) * (k64_steps * SWIZZLE_BLOCK_BYTES)
            + (row & 31) * 16 + ((row >> 5) & 3) * 4)


@dsl_user_op
def e2m1x8_to_bf16x2(q, *, loc=None, ip=None):
    """Eight e2m1 nibbles (nibble i = bits 4i..4i+3) -> four bf16x2 patterns
    ``(lo = nibble i, hi = nibble i + 4)`` for i = 0..3, each worth
    ``2^-126 * e2m1``.

    ``n = q & (0xF << 4i | 0xF << 4i+16)`` holds the two nibbles alone, so
    ``n * (2^a + 2^b)`` is ``n << a | n << b`` (no carries): ``a`` puts the sign
    bits at 15/31, ``b`` the magnitudes at 8..6/24..22; the mask keeps those.
    Nibbles 2, 3, 6, 7 go through ``q >> 8`` (shift amounts stay >= 0).
    """
    return _asm(
        [Uint32] * 4, [(Uint32, q)],
        "{ .reg .b32 h, n0, n1, n2, n3;\n"
        "shr.b32 h, $4, 8;\n"
        "and.b32 n0, $4, 0x000F000F; mul.lo.u32 n0, n0, 4160; and.b32 $0, n0, 0x81C081C0;\n"
        "and.b32 n1, $4, 0x00F000F0; mul.lo.u32 n1, n1, 260; and.b32 $1, n1, 0x81C081C0;\n"
        "and.b32 n2, h, 0x000F000F; mul.lo.u32 n2, n2, 4160; and.b32 $2, n2, 0x81C081C0;\n"
        "and.b32 n3, h, 0x00F000F0; mul.lo.u32 n3, n3, 260; and.b32 $3, n3, 0x81C081C0; }",
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def e4m3x2_to_bf16x2(b0, b1, *, loc=None, ip=None):
    """Two e4m3 scale bytes (zero-extended Uint32) -> ``(bf16x2(s0', s0'),
    bf16x2(s1', s1'))`` with ``s' = e4m3 * 2^118``, exact (e4m3 -> f16 -> f32
    are exact; 2^118 = 0f7A800000)."""
    return _asm(
        [Uint32] * 2, [(Uint32, b0), (Uint32, b1)],
        "{ .reg .b32 c, hh; .reg .b16 l, h; .reg .f32 f0, f1;\n"
        "prmt.b32 c, $2, $3, 0x3340;\n"
        "mov.b32 {l, h}, c;\n"
        "cvt.rn.f16x2.e4m3x2 hh, l;\n"
        "mov.b32 {l, h}, hh;\n"
        "cvt.f32.f16 f0, l; cvt.f32.f16 f1, h;\n"
        "mul.rn.f32 f0, f0, 0f7A800000; mul.rn.f32 f1, f1, 0f7A800000;\n"
        "cvt.rn.bf16x2.f32 $0, f0, f0; cvt.rn.bf16x2.f32 $1, f1, f1; }",
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None):
    """Lane-wise bf16 product, round to nearest (exact for dequantization)."""
    return _asm([Uint32], [(Uint32, a), (Uint32, b)], "mul.rn.bf16x2 $0, $1, $2;", loc=loc, ip=ip)


@dsl_user_op
def ldg_nc_f32(addr, *, loc=None, ip=None):
    return _asm([Float32], [(Int64, addr)], "ld.global.nc.f32 $0, [$1];", loc=loc, ip=ip)
