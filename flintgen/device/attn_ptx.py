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
