"""Loads and stores the QKV kernels need beyond ``ptx.py``: predicated and
sub-16-byte global accesses, 64-bit integers, shared-memory vectors and the
16-byte asynchronous DSMEM store.

Provenance: written for flintgen's fused QKV GEMV. Same conventions as
``ptx.py``: global addresses are ``Int64``, shared addresses 32-bit ``Uint32``;
loads of data another kernel may have written are coherent (no ``.nc``) and
marked as side effects so they stay after ``griddepcontrol.wait``.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from flintgen.device import ptx
from flintgen.device.ptx import _asm, _ldg_or_zero, evict_first_policy, lds_f32x4  # noqa: F401 (re-exported)


# ---------------------------------------------------------------- global
# Weights: coherent loads on purpose. ptxas treats ld.global.nc as freely
# movable and sinks it past griddepcontrol.wait next to its use (seen in the
# SASS: all prefetches after ACQBULK), which serializes the weight stream;
# coherent loads stay where they are issued. L1::no_allocate: streamed once.
# ``policy`` (Int64 from evict_first_policy, or None): the L2 eviction policy of the
# read (ld's plain .L2::evict_first needs 256-bit loads; the cache hint takes any).
def _weight_load(ty, n: int, op: str, addr, pred, policy, loc, ip):
    if policy is not None:   # PTX order: the L1 priority, then the L2 hint
        op = op.replace(".L1::no_allocate", ".L1::no_allocate.L2::cache_hint") if ".L1::" in op else \
            op.replace("ld.global", "ld.global.L2::cache_hint")
    return _ldg_or_zero(ty, n, op, addr, pred, loc, ip, policy)


@dsl_user_op
def ldg_weight_u32x2(addr, pred, policy=None, *, loc=None, ip=None):
    """8 bytes of weights; zeros where ``pred`` (Int32) is 0 (no access then)."""
    return _weight_load(Uint32, 2, "ld.global.L1::no_allocate.v2.u32", addr, pred, policy, loc, ip)


@dsl_user_op
def ldg_weight_u32x4(addr, pred, policy=None, *, loc=None, ip=None):
    """16 bytes of weights; zeros where ``pred`` is 0."""
    return _weight_load(Uint32, 4, "ld.global.L1::no_allocate.v4.u32", addr, pred, policy, loc, ip)


@dsl_user_op
def ldg_weight_u8(addr, pred, policy=None, *, loc=None, ip=None):
    """One byte (a scale), zero-extended; 0 where ``pred`` is 0."""
    return _weight_load(Uint32, 1, "ld.global.u8", addr, pred, policy, loc, ip)


@dsl_user_op
def ldg_i64_pred(addr, pred, fallback, *, loc=None, ip=None):
    """8-byte signed load (positions, slots), ``fallback`` where ``pred`` is 0."""
    return _asm(
        [Int64], [(Int64, addr), (Int32, pred), (Int64, fallback)],
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b64 $0, $3;\n"
        "@p ld.global.s64 $0, [$1]; }",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_nc_u32(addr, *, loc=None, ip=None):
    return _asm([Uint32], [(Int64, addr)], "ld.global.nc.u32 $0, [$1];", loc=loc, ip=ip)


@dsl_user_op
def ldg_nc_u32x2(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32] * 2, [(Int64, addr)], "ld.global.nc.v2.u32 {$0, $1}, [$2];", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_nc_u32x4(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32] * 4, [(Int64, addr)], "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_f32x2_pred(addr, pred, *, loc=None, ip=None):
    return _ldg_or_zero(Float32, 2, "ld.global.v2.f32", addr, pred, loc, ip)


@dsl_user_op
def ldg_f32x4_pred(addr, pred, *, loc=None, ip=None):
    return _ldg_or_zero(Float32, 4, "ld.global.v4.f32", addr, pred, loc, ip)


@dsl_user_op
def ldg_f32_pred(addr, pred, *, loc=None, ip=None):
    return _ldg_or_zero(Float32, 1, "ld.global.f32", addr, pred, loc, ip)


# ---------------------------------------------------------------- bulk copy (TMA)
@dsl_user_op
def bulk_copy_g2s_multicast(dst_smem, src_gmem, mbar_smem, nbytes, cta_mask, *, loc=None, ip=None):
    """1-D bulk copy global -> the same shared offset of every CTA in
    ``cta_mask`` (Int32, bit r = cluster rank r), completing ``nbytes`` on the
    mbarrier at the same offset in each of them."""
    _asm(
        [], [(Uint32, dst_smem), (Int64, src_gmem), (Int32, nbytes), (Uint32, mbar_smem), (Int32, cta_mask)],
        "{ .reg .b16 m; cvt.u16.u32 m, $4;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
        "[$0], [$1], $2, [$3], m; }",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


# ---------------------------------------------------------------- L2
@dsl_user_op
def prefetch_l2(src_gmem, nbytes, issue, *, loc=None, ip=None):
    """Bring ``nbytes`` (Int32, a multiple of 16, > 0) at ``src_gmem`` (16-byte aligned) into L2, where
    ``issue`` (Int32) is nonzero: a bulk prefetch, no destination, nothing waited on."""
    _asm(
        [], [(Int64, src_gmem), (Int32, nbytes), (Int32, issue)],
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$0], $1; }",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


# ---------------------------------------------------------------- PDL
@dsl_user_op
def xor3(a, b, c, *, loc=None, ip=None):
    return _asm([Uint32], [(Uint32, a), (Uint32, b), (Uint32, c)], "lop3.b32 $0, $1, $2, $3, 0x96;",
                loc=loc, ip=ip)


@dsl_user_op
def griddep_wait_after(x, m, *, loc=None, ip=None):
    """``griddepcontrol.wait`` that ptxas cannot schedule before ``x`` exists.

    ptxas hoists a plain wait above independent arithmetic (seen in the SASS:
    ACQBULK first, the early dequantization after it, so nothing overlapped
    the previous kernel). Guarding it with ``(x | 0x10000) != m`` (true: M <=
    8, unknown to ptxas) makes the wait depend on ``x``."""
    _asm(
        [], [(Uint32, x), (Int32, m)],
        "{ .reg .pred p; .reg .b32 y; or.b32 y, $0, 0x10000; setp.ne.u32 p, y, $1;\n"
        "@p griddepcontrol.wait; }",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


# ---------------------------------------------------------------- shared


@dsl_user_op
def lds_u32(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32], [(Uint32, addr)], "ld.shared.u32 $0, [$1];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_u32x2(addr, *, loc=None, ip=None):
    return _asm(
        [Uint32] * 2, [(Uint32, addr)], "ld.shared.v2.u32 {$0, $1}, [$2];",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def st_async_cluster_u32x4(addr, a, b, c, d, mbar, *, loc=None, ip=None):
    """16-byte asynchronous store to a ``mapa``-translated shared address of a
    cluster peer, completing 16 bytes on the peer's mbarrier ``mbar`` (also
    ``mapa``-translated): the receiver waits on its mbarrier, no cluster barrier."""
    _asm(
        [], [(Uint32, addr), (Uint32, a), (Uint32, b), (Uint32, c), (Uint32, d), (Uint32, mbar)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def lds_u16(addr, *, loc=None, ip=None):
    """One bf16 from shared memory, zero-extended into bits 0-15."""
    return _asm(
        [Uint32], [(Uint32, addr)], "ld.shared.u16 $0, [$1];", side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ldg_nc_u16(addr, *, loc=None, ip=None):
    return _asm([Uint32], [(Int64, addr)], "ld.global.nc.u16 $0, [$1];", loc=loc, ip=ip)


# ---------------------------------------------------------------- E-wide bf16 / fp32 runs
# A lane of the per-head epilogue owns runs of E consecutive elements (bf16: 1,
# 2, 4 or 8; fp32: 1, 2 or 4; flintgen.layout.EpilogueLanes):
# these pick the one access that moves them. Trace-time dispatch.
def _bf16_words(e: int) -> None:
    if e not in (1, 2, 4, 8):
        raise ValueError(f"a bf16 run of {e} elements: 1, 2, 4 or 8 are supported")


def _unpack(words):
    out = []
    for w in words:
        out += [ptx.bf16_lo(w), ptx.bf16_hi(w)]
    return out


def lds_bf16_run(addr, e: int):
    """``e`` consecutive bf16 at shared ``addr`` as Float32 values."""
    if e == 1:
        return [ptx.bf16_lo(lds_u16(addr))]
    return _unpack(lds_words_run(addr, e))


def lds_words_run(addr, e: int):
    """The raw bits of ``e`` consecutive bf16 at shared ``addr`` (for copies)."""
    _bf16_words(e)
    if e == 1:
        return [lds_u16(addr)]
    if e == 8:
        return list(ptx.lds_u32x4(addr))
    return [lds_u32(addr)] if e == 2 else list(lds_u32x2(addr))


def ldg_nc_bf16_run(addr, e: int):
    """``e`` consecutive read-only bf16 (model weights) as Float32 values."""
    _bf16_words(e)
    if e == 1:
        return [ptx.bf16_lo(ldg_nc_u16(addr))]
    if e == 8:
        return _unpack(list(ldg_nc_u32x4(addr)))
    return _unpack([ldg_nc_u32(addr)] if e == 2 else list(ldg_nc_u32x2(addr)))


def ldg_f32_run(addr, e: int, pred):
    """``e`` consecutive fp32 (zeros where ``pred`` is 0)."""
    if e not in (1, 2, 4):
        raise ValueError(f"an fp32 run of {e} elements: 1, 2 or 4 are supported")
    if e == 1:
        return [ldg_f32_pred(addr, pred)]
    return list(ldg_f32x2_pred(addr, pred)) if e == 2 else list(ldg_f32x4_pred(addr, pred))


def pack_bf16_run(vals):
    """Round Float32 values to bf16 and pack them into words (e = 1: one word
    whose bits 0-15 hold the value)."""
    if len(vals) == 1:
        return [ptx.bf16x2(vals[0], Float32(0.0))]
    return [ptx.bf16x2(vals[2 * i], vals[2 * i + 1]) for i in range(len(vals) // 2)]


def stg_words_run(addr, words, e: int):
    """Store the words of ``e`` consecutive bf16 to global ``addr``."""
    _bf16_words(e)
    if e == 1:
        ptx.stg_b16(addr, words[0])
    elif e == 2:
        ptx.stg_u32(addr, words[0])
    elif e == 4:
        ptx.stg_u32x2(addr, words[0], words[1])
    else:
        ptx.stg_u32x4(addr, words[0], words[1], words[2], words[3])
