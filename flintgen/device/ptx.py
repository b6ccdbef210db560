"""Inline-PTX wrappers shared by every generated kernel.

Each wrapper is one PTX instruction (or a short fixed sequence) emitted through
``llvm.inline_asm`` with explicit register constraints. Explicit constraints
matter: ``cute.arch.inline_ptx`` turns constant integer operands into
immediates, which instructions such as ``mma`` and ``prmt`` reject.

Addresses are plain integers: global addresses are ``Int64`` (``"l"``),
shared-memory addresses are 32-bit ``Uint32`` offsets in the shared window
(``"r"``), as the ``.shared`` state space expects.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_CONSTRAINT = {Float32: "f", Int32: "r", Uint32: "r", Int64: "l"}
_IR_TYPE = {Float32: T.f32, Int32: T.i32, Uint32: T.i32, Int64: T.i64}


def _asm(results, args, asm, *, side_effects=False, loc=None, ip=None):
    """Emit ``asm`` with typed operands.

    ``results``: result DSL types (outputs are $0..$k-1); ``args``: pairs of
    (DSL type, value), inputs follow the outputs in operand numbering.
    Returns None, one value, or a tuple.
    """
    ops = [ty(v).ir_value(loc=loc, ip=ip) for ty, v in args]
    cons = ",".join(
        ["=" + _CONSTRAINT[r] for r in results] + [_CONSTRAINT[ty] for ty, _ in args]
    )
    if side_effects and not results:
        cons = cons + ",~{memory}" if cons else "~{memory}"
    if not results:
        llvm.inline_asm(
            None, ops, asm, cons, has_side_effects=True,
            asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
        )  # fmt: skip
        return None
    if len(results) == 1:
        res = llvm.inline_asm(
            _IR_TYPE[results[0]](), ops, asm, cons, has_side_effects=side_effects,
            asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
        )  # fmt: skip
        return results[0](res)
    st = llvm.StructType.get_literal([_IR_TYPE[r]() for r in results])
    res = llvm.inline_asm(
        st, ops, asm, cons, has_side_effects=side_effects,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return tuple(
        r(llvm.extractvalue(_IR_TYPE[r](), res, [i], loc=loc, ip=ip))
        for i, r in enumerate(results)
    )


# ---------------------------------------------------------------- global memory
@dsl_user_op
def ldg_u32x4(addr, *, loc=None, ip=None):
    """16-byte global load (coherent: the data may come from the previous kernel)."""
    return _asm(
        [Uint32] * 4, [(Int64, addr)],
        "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_cg_f32x4(addr, *, loc=None, ip=None):
    """16-byte load bypassing L1: partials written by other CTAs of this grid."""
    return _asm(
        [Float32] * 4, [(Int64, addr)],
        "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


def _ldg_or_zero(ty, n: int, op: str, addr, pred, loc, ip, policy=None):
    """``n`` 32-bit values of ``ty`` loaded by ``op`` (e.g. ``ld.global.v4.f32``),
    zeros where ``pred`` (Int32) is 0, and then no access at all. ``policy``
    (Int64, a ``createpolicy`` result, or None): ``op`` carries ``.L2::cache_hint``
    and reads with that L2 policy."""
    dst = "{" + ", ".join(f"${i}" for i in range(n)) + "}" if n > 1 else "$0"
    zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(n))
    hint, ops = ("", []) if policy is None else (f", ${n + 2}", [(Int64, policy)])
    return _asm(
        [ty] * n, [(Int64, addr), (Int32, pred)] + ops,
        f"{{ .reg .pred p; setp.ne.s32 p, ${n + 1}, 0; {zeros}\n@p {op} {dst}, [${n}]{hint}; }}",
        side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ldg_u32_pred(addr, pred, *, loc=None, ip=None):
    """4-byte global load returning 0 where ``pred`` (Int32) is 0: never touches
    the address then, so a block-table row may be read past its valid length."""
    return _ldg_or_zero(Uint32, 1, "ld.global.u32", addr, pred, loc, ip)


@dsl_user_op
def stg_u32x4(addr, a, b, c, d, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Uint32, a), (Uint32, b), (Uint32, c), (Uint32, d)],
        "st.global.v4.u32 [$0], {$1, $2, $3, $4};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_u32x2(addr, a, b, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Uint32, a), (Uint32, b)],
        "st.global.v2.u32 [$0], {$1, $2};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_u32(addr, a, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Uint32, a)],
        "st.global.u32 [$0], $1;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_b16(addr, w, *, loc=None, ip=None):
    """Store the low 16 bits of ``w`` (one bf16) to global ``addr``."""
    _asm(
        [], [(Int64, addr), (Uint32, w)],
        "{ .reg .b16 h; cvt.u16.u32 h, $1; st.global.b16 [$0], h; }",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_b8(addr, w, *, loc=None, ip=None):
    """Store the low 8 bits of ``w`` (one fp8 byte) to global ``addr`` (PTX
    lets st take a register wider than its type: the value is truncated)."""
    _asm(
        [], [(Int64, addr), (Uint32, w)], "st.global.b8 [$0], $1;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_f32x4(addr, a, b, c, d, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Float32, a), (Float32, b), (Float32, c), (Float32, d)],
        "st.global.v4.f32 [$0], {$1, $2, $3, $4};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_f32(addr, a, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Float32, a)],
        "st.global.f32 [$0], $1;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def stg_i32_relaxed(addr, a, *, loc=None, ip=None):
    _asm(
        [], [(Int64, addr), (Int32, a)],
        "st.relaxed.gpu.global.s32 [$0], $1;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_cg_f32x2(addr, *, loc=None, ip=None):
    """8-byte load bypassing L1 (partials of other CTAs)."""
    return _asm(
        [Float32] * 2, [(Int64, addr)], "ld.global.cg.v2.f32 {$0, $1}, [$2];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_cg_f32(addr, *, loc=None, ip=None):
    """4-byte load bypassing L1 (partials of other CTAs)."""
    return _asm([Float32], [(Int64, addr)], "ld.global.cg.f32 $0, [$1];", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_acquire_i32(addr, *, loc=None, ip=None):
    """Acquire load (gpu scope) of an arrival counter: what the CTAs that
    counted released is visible after it."""
    return _asm([Int32], [(Int64, addr)], "ld.acquire.gpu.global.b32 $0, [$1];", side_effects=True,
                loc=loc, ip=ip)


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    _asm([], [(Int32, ns)], "nanosleep.u32 $0;", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def atomic_add_acq_rel(addr, v, *, loc=None, ip=None):
    """Returns the old value; acq_rel orders this CTA's partial stores before
    the arrival and the last CTA's partial loads after it."""
    return _asm(
        [Int32], [(Int64, addr), (Int32, v)],
        "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


# ---------------------------------------------------------------- shared memory
@dsl_user_op
def lds_u32x4(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32] * 4, [(Uint32, addr)],
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_f32x4(addr, *, loc=None, ip=None):
    return _asm(
        [Float32] * 4, [(Uint32, addr)],
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_f32(addr, *, loc=None, ip=None):
    return _asm(
        [Float32], [(Uint32, addr)], "ld.shared.f32 $0, [$1];",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_i32(addr, *, loc=None, ip=None):
    return _asm(
        [Int32], [(Uint32, addr)], "ld.shared.s32 $0, [$1];",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def sts_f32(addr, v, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Float32, v)], "st.shared.f32 [$0], $1;",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def sts_i32(addr, v, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Int32, v)], "st.shared.s32 [$0], $1;",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def smem_addr(ptr, *, loc=None, ip=None):
    """32-bit shared-window address of a shared-memory pointer or tensor."""
    it = getattr(ptr, "iterator", ptr)
    return Uint32(it.toint(loc=loc, ip=ip))


# ---------------------------------------------------------------- bulk copy (TMA)
@dsl_user_op
def bulk_copy_g2s(dst_smem, src_gmem, mbar_smem, nbytes, policy=None, *, loc=None, ip=None):
    """1-D bulk copy global -> shared completing ``nbytes`` on an mbarrier.
    ``policy`` (Int64 from evict_first_policy, or None): the L2 policy of the read."""
    hint, tail, ops = ("", "", []) if policy is None else (".L2::cache_hint", ", $4", [(Int64, policy)])
    _asm(
        [], [(Uint32, dst_smem), (Int64, src_gmem), (Int32, nbytes), (Uint32, mbar_smem)] + ops,
        f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint} [$0], [$1], $2, [$3]{tail};",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def evict_first_policy(*, loc=None, ip=None):
    """An L2 cache policy (Int64) for reads whose lines L2 evicts first (read once, dead after)."""
    return _asm([Int64], [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", loc=loc, ip=ip)


# ---------------------------------------------------------------- cluster / DSMEM
@dsl_user_op
def mapa(smem, rank, *, loc=None, ip=None):
    """Address of the same shared-memory offset in CTA ``rank`` of the cluster."""
    return _asm(
        [Uint32], [(Uint32, smem), (Int32, rank)],
        "mapa.shared::cluster.u32 $0, $1, $2;", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def st_cluster_f32x4(addr, a, b, c, d, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Float32, a), (Float32, b), (Float32, c), (Float32, d)],
        "st.shared::cluster.v4.f32 [$0], {$1, $2, $3, $4};", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def st_cluster_f32(addr, a, *, loc=None, ip=None):
    _asm(
        [], [(Uint32, addr), (Float32, a)],
        "st.shared::cluster.f32 [$0], $1;", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


# ---------------------------------------------------------------- arithmetic
@dsl_user_op
def ex2(x, *, loc=None, ip=None):
    """2^x (MUFU.EX2, ftz): ex2(-inf) = +0, which masked logits rely on."""
    return _asm([Float32], [(Float32, x)], "ex2.approx.ftz.f32 $0, $1;", loc=loc, ip=ip)


@dsl_user_op
def rsqrt(x, *, loc=None, ip=None):
    return _asm([Float32], [(Float32, x)], "rsqrt.approx.ftz.f32 $0, $1;", loc=loc, ip=ip)


@dsl_user_op
def fma(a, b, c, *, loc=None, ip=None):
    return _asm(
        [Float32], [(Float32, a), (Float32, b), (Float32, c)],
        "fma.rn.f32 $0, $1, $2, $3;", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def neg_inf(*, loc=None, ip=None):
    return _asm([Float32], [], "mov.b32 $0, 0xff800000;", loc=loc, ip=ip)


@dsl_user_op
def bf16x2(lo, hi, *, loc=None, ip=None):
    """Round two fp32 to bf16 (RN) and pack: ``lo`` in bits 0-15."""
    return _asm(
        [Uint32], [(Float32, hi), (Float32, lo)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None):
    """``a / b``, IEEE fp32 division rounded to nearest even (subnormals kept,
    no ftz): bit-exact with torch's fp32 ``/``, which a multiply by a
    reciprocal is not."""
    return _asm([Float32], [(Float32, a), (Float32, b)], "div.rn.f32 $0, $1, $2;", loc=loc, ip=ip)


@dsl_user_op
def e4m3x2(lo, hi, *, loc=None, ip=None):
    """Two fp32 to fp8 e4m3 (round to nearest even, saturating to +-448,
    NaN stays NaN): ``lo`` in bits 0-7, ``hi`` in bits 8-15, bits 16-31
    zero. sm_89+; the instruction puts its first source in the upper byte."""
    return _asm(
        [Uint32], [(Float32, hi), (Float32, lo)],
        "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $1, $2; cvt.u32.u16 $0, h; }", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def e4m3x4(a, b, c, d, *, loc=None, ip=None):
    """Four fp32 to e4m3 (as ``e4m3x2``) packed in one word: ``a`` in bits
    0-7, ``b`` 8-15, ``c`` 16-23, ``d`` 24-31 (memory order)."""
    return _asm(
        [Uint32], [(Float32, b), (Float32, a), (Float32, d), (Float32, c)],
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $1, $2;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $3, $4; mov.b32 $0, {lo, hi}; }", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def bf16_lo(w, *, loc=None, ip=None):
    """fp32 value of the bf16 in bits 0-15 of ``w`` (exact)."""
    return _asm([Float32], [(Uint32, w)], "shl.b32 $0, $1, 16;", loc=loc, ip=ip)


@dsl_user_op
def bf16_hi(w, *, loc=None, ip=None):
    """fp32 value of the bf16 in bits 16-31 of ``w`` (exact)."""
    return _asm([Float32], [(Uint32, w)], "and.b32 $0, $1, 0xffff0000;", loc=loc, ip=ip)


@dsl_user_op
def prmt(a, b, sel, *, loc=None, ip=None):
    return _asm(
        [Uint32], [(Uint32, a), (Uint32, b), (Uint32, sel)],
        "prmt.b32 $0, $1, $2, $3;", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def mma_bf16_16816(c, a, b0, b1, *, loc=None, ip=None):
    """D = A B + C, m16n8k16, bf16 inputs, fp32 accumulate.

    ``c``: 4 Float32, ``a``: 4 Uint32 (bf16x2), ``b0``/``b1``: Uint32 (bf16x2).
    """
    return _asm(
        [Float32] * 4,
        [(Uint32, a[0]), (Uint32, a[1]), (Uint32, a[2]), (Uint32, a[3]),
         (Uint32, b0), (Uint32, b1),
         (Float32, c[0]), (Float32, c[1]), (Float32, c[2]), (Float32, c[3])],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def select_f32(pred, a, b, *, loc=None, ip=None):
    """``a`` where ``pred`` (Int32) is nonzero, else ``b`` (bits unchanged)."""
    return _asm([Float32], [(Int32, pred), (Float32, a), (Float32, b)],
                "{ .reg .pred p; setp.ne.s32 p, $1, 0; selp.f32 $0, $2, $3, p; }", loc=loc, ip=ip)
