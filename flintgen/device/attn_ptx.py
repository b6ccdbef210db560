"""Inline-PTX wrappers used only by decode attention (``ptx.py`` has the
shared ones; this module uses its ``_asm`` helper and conventions: global
addresses are Int64, shared addresses Uint32)."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from flintgen.device.ptx import _asm, lds_f32x4, stg_b16  # noqa: F401 (re-exported)


@dsl_user_op
def selp_f32(a, b, pred, *, loc=None, ip=None):
    """``a if pred != 0 else b`` (branch-free; ``pred`` Int32)."""
    return _asm(
        [Float32], [(Float32, a), (Float32, b), (Int32, pred)],
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; selp.f32 $0, $1, $2, p; }", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def selp_u32(a, b, pred, *, loc=None, ip=None):
    """``a if pred != 0 else b`` (branch-free; ``pred`` Int32)."""
    return _asm(
        [Uint32], [(Uint32, a), (Uint32, b), (Int32, pred)],
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; selp.b32 $0, $1, $2, p; }", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def rcp_approx(x, *, loc=None, ip=None):
    """1 / x within 1 ulp (``rcp.approx.ftz``: MUFU.RCP; ftz). Soft-capped
    logits use it (``decode_mma.softcap_logit``): with the IEEE ``rcp.rn`` 3
    of 64 soft-capping variants spilled (8 bytes of stack at 80 registers);
    with this one all compile clean."""
    return _asm([Float32], [(Float32, x)], "rcp.approx.ftz.f32 $0, $1;", loc=loc, ip=ip)


@dsl_user_op
def sts_f32x2(addr, a, b, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Float32, a), (Float32, b)],
        "st.shared.v2.f32 [$0], {$1, $2};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_u32x2(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32] * 2, [(Uint32, addr)], "ld.shared.v2.u32 {$0, $1}, [$2];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_f32x2(addr, *, loc=None, ip=None):
    return _asm(
        [Float32] * 2, [(Uint32, addr)], "ld.shared.v2.f32 {$0, $1}, [$2];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_f32x2(addr, a, b, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Float32, a), (Float32, b)],
        "st.global.v2.f32 [$0], {$1, $2};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def st_cluster_f32x2(addr, a, b, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Float32, a), (Float32, b)],
        "st.shared::cluster.v2.f32 [$0], {$1, $2};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_u32(addr, *, loc=None, ip=None):
    return _asm([Uint32], [(Uint32, addr)], "ld.shared.u32 $0, [$1];", side_effects=True, loc=loc, ip=ip)


# ---------------------------------------------------------------- fp8 (e4m3) KV cache
# sm_90 has no e4m3 -> bf16 conversion; e4m3 -> f16 is exact (every e4m3
# value, subnormals included, is an f16 value; e4m3fn NaN -> f16 NaN), so an
# e4m3 cache feeds the f16 mma.
@dsl_user_op
def e4m3x4_to_f16x2x2(w, *, loc=None, ip=None):
    """Four e4m3 bytes of ``w`` (byte k = element k) -> two f16x2 words:
    (elements 0, 1), (elements 2, 3), the lower element in bits 0-15
    (``cvt.rn.f16x2.e4m3x2``: the low byte of the 16-bit source goes to the
    low half). Exact."""
    return _asm(
        [Uint32] * 2, [(Uint32, w)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def e4m3x2_to_f16x2(w, *, loc=None, ip=None):
    """The two e4m3 bytes in bits 0-15 of ``w`` -> one f16x2 word (exact)."""
    return _asm(
        [Uint32], [(Uint32, w)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, lo; }", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def bf16x2_to_f16x2_sat(w, *, loc=None, ip=None):
    """A bf16x2 word -> f16x2 (RN, ``.satfinite``): exact for |x| in
    [2^-14, 65504] and 0; magnitudes past 65504 (and +-inf) saturate to
    +-65504; below 2^-14 the f16 subnormals keep an absolute precision of
    2^-24 (values under 2^-25 become +-0); NaN stays NaN."""
    return _asm(
        [Uint32], [(Uint32, w)],
        "{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xffff0000; "
        "cvt.rn.satfinite.f16x2.f32 $0, hi, lo; }",
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def f16x2(lo, hi, *, loc=None, ip=None):
    """Round two fp32 to f16 (RN) and pack: ``lo`` in bits 0-15 (softmax
    probabilities in [0, 1]: no overflow)."""
    return _asm([Uint32], [(Float32, hi), (Float32, lo)], "cvt.rn.f16x2.f32 $0, $1, $2;", loc=loc, ip=ip)


@dsl_user_op
def mma_f16_16816(c, a, b0, b1, *, loc=None, ip=None):
    """D = A B + C, m16n8k16, f16 inputs, fp32 accumulate (operands as
    ``ptx.mma_bf16_16816``, f16x2 words)."""
    return _asm(
        [Float32] * 4,
        [(Uint32, a[0]), (Uint32, a[1]), (Uint32, a[2]), (Uint32, a[3]),
         (Uint32, b0), (Uint32, b1),
         (Float32, c[0]), (Float32, c[1]), (Float32, c[2]), (Float32, c[3])],
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        loc=loc, ip=ip,
    )  # fmt: skip
