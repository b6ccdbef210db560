"""Warpgroup MMA (``wgmma``, sm_90a) of the streaming QKV GEMV: a unit's
weight rows (A, the MMA's M) and xn's tokens (B, its N) both read by the
tensor cores straight from shared memory, so no warp re-reads xn.

Provenance: written for flintgen's streaming QKV GEMV (PTX ISA, "Asynchronous
Warpgroup Level Matrix Multiply-Accumulate"; descriptor fields as CUTLASS's
``GmmaDescriptor``).

Shared layout of one operand of ``R`` rows (R % 8 == 0) and a unit's 64 K
values (128 bytes: one row of the 128-byte swizzle), K-major, swizzled:
rows at 128-byte pitch, the 16-byte chunk c of row r stored at chunk
``c ^ (r % 8)`` of its row, in atoms of 8 rows aligned to 1024 bytes (the
hardware swizzles address bits, so the atoms must sit on 1024-byte
boundaries)::

    byte 128 r + 16 (c ^ (r % 8))   holds row r's values [8 c, 8 c + 8)
    SBO = 1024   (the next 8 rows)

A row's 128 bytes are one line of global memory and, swizzled, one
conflict-free shared-memory wavefront: 8 threads copy a row
(flintgen.device.weight_stream.issue_rows). The unswizzled canonical layout
(8 x 16-byte core matrices) was measured much slower (a warp's copies
covering 8 rows x 64 bytes: benchmarks/results/qkv_stream.md). A k16 step
``kk`` of the unit starts ``32 kk`` bytes in. Accumulators
of ``m64nNk16`` (N = tokens, fp32): thread (warp w of the warpgroup, g =
lane / 4, t = lane % 4) holds ``d[4 nt + j]`` = row ``16 w + g + 8 (j // 2)``,
token ``8 nt + 2 t + j % 2``: the layout of ``mma.sync.m16n8k16``'s C of the
warp's 16-row tile over the n-tiles (flintgen.device.gemv), so partials,
merge and epilogue are shared with the mma.sync path.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flintgen.layout import K_STEP, WARPGROUP_ROWS  # noqa: F401  (the M of one wgmma)
from flintgen.device.ptx import _asm

ROW_BYTES = K_STEP * 2             # a row of a unit: one 128-byte swizzle row
CHUNK_BYTES = 16                    # 8 bf16
SBO = 8 * ROW_BYTES                 # bytes between 8-row groups (one swizzle atom)
ATOM_ALIGN = SBO                    # the swizzle is of address bits: atoms at 1024-byte boundaries
K16_BYTES = 16 * 2                  # a k16 step along a row
K16_STEPS = K_STEP // 16            # wgmma k16 steps of a unit
_LBO_UNUSED = 1                     # K-major swizzled: one atom spans the unit's K
_LAYOUT_SWIZZLE_128B = 1
DESC_HI = (SBO >> 4) | (_LAYOUT_SWIZZLE_128B << 30)   # bits 32..63: stride byte offset, layout type


def core_offset(row, chunk):
    """Byte offset of row ``row``'s 16-byte chunk ``chunk`` (values [8 chunk, 8 chunk + 8)) in an operand."""
    return row * ROW_BYTES + (chunk ^ (row % 8)) * CHUNK_BYTES


def desc_lo(addr):
    """Bits 0..31 of a descriptor of the operand at shared address ``addr`` (Uint32, in a 1024-byte
    aligned atom's first row): start address >> 4 (14 bits), the (unused) leading byte offset at bit 16."""
    return ((addr >> 4) & 0x3FFF) | Uint32(_LBO_UNUSED << 16)


@dsl_user_op
def fence_proxy_async(*, loc=None, ip=None):
    """Make this thread's shared-memory writes (generic proxy: st.shared, cp.async) visible to
    the async proxy (wgmma's operand reads); a barrier after it publishes every thread's."""
    _asm([], [], "fence.proxy.async.shared::cta;", side_effects=True, loc=loc, ip=ip)


def _tied_asm(acc, inputs, asm, loc, ip):
    """``asm`` with the accumulators ``acc`` (Float32) as $0.. in and out (tied), then ``inputs``
    ((DSL type, value) pairs, 32-bit). Returns the accumulators as the asm leaves them."""
    nd = len(acc)
    ops = [ty(v).ir_value(loc=loc, ip=ip) for ty, v in inputs] + [Float32(x).ir_value(loc=loc, ip=ip) for x in acc]
    cons = ",".join(["=f"] * nd + ["r"] * len(inputs) + [str(i) for i in range(nd)])
    st = llvm.StructType.get_literal([T.f32()] * nd)
    res = llvm.inline_asm(st, ops, asm, cons + ",~{memory}", has_side_effects=True,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(nd)]


@dsl_user_op
def mma_unit(acc, a_lo, b_lo, n: int, ksteps: int, subs: int = 1, sub_bytes: int = 0, *, loc=None, ip=None):
    """``acc`` (n / 2 Float32, the layout above) += A B^T over ``ksteps`` k16 steps, A = the warpgroup's
    64 rows at descriptor ``a_lo``, B = ``n`` tokens at ``b_lo`` (desc_lo words of their k-step-0
    addresses), and the same for each of ``subs`` operand pairs ``sub_bytes`` further on (a stage's
    sub-stages: a unit of several 64-value steps): one ``wgmma.m64n{n}k16`` per step, committed as one
    group and left in flight: the caller waits (``wait_group``) before reading the accumulators or
    reusing the operands' shared memory. The accumulators are the asm's tied operands (and
    wait_group's), so their reads follow the wait."""
    nd = n // 2
    assert n % 8 == 0 and 8 <= n <= 256 and len(acc) == nd
    d = ", ".join(f"${i}" for i in range(nd))
    a, b, one = f"${nd}", f"${nd + 1}", f"${nd + 2}"
    body = [f"mov.b32 hi, {DESC_HI};", f"setp.ne.s32 p, {one}, 0;", "wgmma.fence.sync.aligned;"]
    assert sub_bytes % 16 == 0 and (subs == 1 or sub_bytes > 0)
    for sub, kk in ((sub, kk) for sub in range(subs) for kk in range(ksteps)):
        off = (sub * sub_bytes + kk * K16_BYTES) >> 4   # the 14-bit address field: shared memory < 256 KB
        body += [f"add.u32 lo, {a}, {off};", "mov.b64 da, {lo, hi};",
                 f"add.u32 lo, {b}, {off};", "mov.b64 db, {lo, hi};",
                 f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, da, db, p, 1, 1, 0, 0;"]
    body.append("wgmma.commit_group.sync.aligned;")
    asm = "{\n.reg .b64 da, db;\n.reg .b32 lo, hi;\n.reg .pred p;\n" + "\n".join(body) + "\n}"
    return _tied_asm(acc, [(Uint32, a_lo), (Uint32, b_lo), (Int32, 1)], asm, loc, ip)


@dsl_user_op
def wait_group(acc, pending: int, *, loc=None, ip=None):
    """``wgmma.wait_group pending``: at most ``pending`` of this warp's committed groups still in
    flight. ``acc``: the accumulators of those groups (tied through, so their reads follow the wait)."""
    return _tied_asm(acc, [], f"wgmma.wait_group.sync.aligned {int(pending)};", loc, ip)
